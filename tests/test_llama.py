"""The Llama family (loom.models.llama, model=llama*): logits parity with transformers on
checkpoints written by `save_pretrained` (one file and sharded, tied and untied heads, both
config.json spellings, Qwen2's q/k/v biases), the torch-free arithmetic against the module
built on the meta device, the plan, the tensor-parallel plan (under torch's fake process
group) and the pipeline split, and the refusals. In-process only: no launch, no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loom.errors import ConfigError
from loom.models import build_module, model_spec
from loom.models.llama.hf_config import llama_shapes
from loom.pipeline import resolve

SIZED = ["llama_tiny", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b"]
ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single"]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# a short original context, so that Llama-3.1's scaling changes the frequencies this test uses
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}


def _save(model, path: Path, sharded: bool) -> Path:
    """Random weights (norms and biases too, so none is at its init value), then save_pretrained."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().save_pretrained(path, max_shard_size="50KB" if sharded else "1GB")
    assert (path / "model.safetensors.index.json").is_file() == sharded
    assert len(list(path.glob("*.safetensors"))) > 1 if sharded else (path / "model.safetensors").is_file()
    return path


def _hf_llama(path: Path, tie: bool, sharded: bool, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=dict(SCALING), rms_norm_eps=1e-5,
                         tie_word_embeddings=tie, **extra)
    return _save(LlamaForCausalLM(config), path, sharded)


def _as_transformers4(path: Path) -> None:
    """Rewrite config.json as transformers 4 (and Meta's published files) spell the rotary."""
    f = path / "config.json"
    data = json.loads(f.read_text())
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    f.write_text(json.dumps(data))


def _loom_from(path: Path, *overrides: str):
    """The run's config and its model, weights loaded as the worker loads model.init_from
    (FileInit through construct: meta device, then materialized tensor by tensor)."""
    cfg = resolve(["model=llama", f"model.init_from={path}", *ONE_CPU, *overrides])
    module = build_module(cfg)
    module.init_source = cfg.model.init_from
    module.configure_model()
    return cfg, module.model.eval()


def _logits_match(hf, loom, vocab: int) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randint(0, vocab, (2, 200))
    with torch.no_grad():
        want, got = hf(x).logits, loom(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5
    return x


@pytest.mark.parametrize("tie,sharded", [(False, False), (True, True), (False, True)])
def test_llama_checkpoint_imports_name_for_name_with_the_same_logits(tmp_path, tie, sharded):
    from transformers import AutoModelForCausalLM

    path = _hf_llama(tmp_path / "hf", tie, sharded)
    if sharded and not tie:
        _as_transformers4(path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg, loom = _loom_from(path)
    m = cfg.model
    assert (m.d_model, m.n_kv_heads, m.intermediate_size, m.tie_embeddings, m.qkv_bias) == (64, 2, 160, tie, False)
    assert m.rope_theta == 500000.0 and m.rope_scaling["original_max_position_embeddings"] == 16
    assert m.init_from == str(path) and m.init_from_fingerprint.startswith("files=")
    names = set(loom.state_dict())
    assert names == set(hf.state_dict()) - ({"lm_head.weight"} if tie else set())
    assert names == set(llama_shapes(m))
    x = _logits_match(hf, loom, 300)
    # export: Loom's state dict loads by name into transformers, with the same logits
    fresh = AutoModelForCausalLM.from_config(hf.config).eval()
    fresh.load_state_dict(loom.state_dict(), strict=not tie)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, hf(x).logits)


def test_llama3_scaling_is_applied(tmp_path):
    """The same weights without the frequency scaling give other logits (the parity above
    would not hold with plain rotary)."""
    from transformers import AutoModelForCausalLM

    path = _hf_llama(tmp_path / "hf", tie=False, sharded=False)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    _, loom = _loom_from(path)
    loom.model.rotary_emb.scaling = None
    x = torch.randint(0, 300, (2, 200))
    with torch.no_grad():
        assert (loom(x) - hf(x).logits).abs().max().item() > 1e-3


def test_qwen2_takes_every_field_from_config_json(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = _save(Qwen2ForCausalLM(Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=True)),
                 tmp_path / "qwen", sharded=False)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg, loom = _loom_from(path)
    m = cfg.model
    assert m.qkv_bias and m.tie_embeddings and m.rope_scaling is None
    assert (m.rope_theta, m.rms_norm_eps, m.n_layer, m.vocab_size, m.block_size) == (1e6, 1e-6, 2, 300, 256)
    assert "model.layers.1.self_attn.k_proj.bias" in loom.state_dict()
    _logits_match(hf, loom, 300)


def test_mistral_without_a_sliding_window_is_llama(tmp_path):
    """issue 39: `model=llama` takes a MistralForCausalLM checkpoint whose window never binds (Mistral
    v0.2+: sliding_window null), with transformers' logits; one with a window is refused."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    path = _save(MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)), tmp_path / "mistral", sharded=False)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg, loom = _loom_from(path)
    assert not cfg.model.qkv_bias and cfg.model.n_kv_heads == TINY["num_key_value_heads"]
    _logits_match(hf, loom, 300)
    windowed = _save(MistralForCausalLM(MistralConfig(**TINY, sliding_window=16)), tmp_path / "windowed",
                     sharded=False)
    with pytest.raises(ConfigError, match="sliding_window=16 < max_position_embeddings"):
        resolve(["model=llama", f"model.init_from={windowed}"])


@pytest.mark.parametrize("name", SIZED)
def test_spec_counts_the_module_built_on_the_meta_device(name):
    cfg = resolve([f"model={name}"])
    with torch.device("meta"):
        model = build_module(cfg).build_model()
    spec = model_spec(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == llama_shapes(cfg.model)
    assert ("lm_head.weight" in model.state_dict()) == (not cfg.model.tie_embeddings)
    published = {"llama3_1b": 1.24e9, "llama3_8b": 8.03e9}.get(name)
    if published:
        assert abs(spec.params - published) / published < 0.005


def test_flops_per_token_agree_with_torch_flop_counter():
    """6N + 12*L*H*Q*T against FlopCounterMode's count of one forward (x3 for training); the tied
    head's matmul is in both. Only the norms' and embedding's elementwise work differ (< 1%)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = resolve(["model=llama_tiny", "dataset.seq_len=64"])
    model = build_module(cfg).build_model()
    counter = FlopCounterMode(display=False)  # the math kernel: its matmuls are counted on CPU
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.zeros(2, 64, dtype=torch.long))
    measured = 3 * counter.get_total_flops() / (2 * 64)
    spec = model_spec(cfg)
    assert abs(measured - spec.flops_per_token) / spec.flops_per_token < 0.01


def test_fresh_init_is_name_seeded_and_follows_the_llama_rule():
    from loom.models.lit import network_kwargs
    from loom.models.llama.network import Llama

    cfg = resolve(["model=llama_tiny", "seed=5"])
    module = build_module(cfg)
    module.configure_model()  # meta device, then materialized by name
    state = module.model.state_dict()
    direct = Llama(**network_kwargs(cfg.model))
    direct.reset_parameters(seed=5)
    assert all(torch.equal(state[k], v) for k, v in direct.state_dict().items())
    assert torch.equal(state["model.layers.0.input_layernorm.weight"], torch.ones(128))
    assert 0.018 < state["model.layers.1.mlp.up_proj.weight"].std().item() < 0.022


def test_activation_checkpointing_wraps_each_decoder_layer_and_keeps_the_names():
    plain, wrapped = (build_module(resolve(["model=llama_tiny", f"trainer.activation_checkpointing={mode}"]))
                      for mode in ("none", "full"))
    for module in (plain, wrapped):
        module.configure_model()
    assert [type(m).__name__ for m in wrapped.model.model.layers] == ["CheckpointWrapper"] * 2
    assert list(wrapped.model.state_dict()) == list(plain.model.state_dict())
    x = torch.randint(0, 256, (2, 32))
    losses = [m.model(x).float().logsumexp(-1).mean() for m in (plain, wrapped)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    grads = [m.model.model.embed_tokens.weight.grad for m in (plain, wrapped)]
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_llama3_8b_fits_fsdp_on_h100x8_but_not_ddp():
    from loom.plan import make_plan

    plan = make_plan(resolve(["model=llama3_8b", "strategy=fsdp", "hardware=h100x8"]))
    assert plan.fits and model_spec(resolve(["model=llama3_8b"])).params == 8_030_261_248
    assert not make_plan(resolve(["model=llama3_8b", "strategy=ddp", "hardware=h100x8"])).fits


def test_fsdp_shard_units_name_the_llama_classes():
    """Each family names its module classes in the registry (no config-key sniffing in strategies)."""
    assert resolve(["model=llama_tiny", "strategy=fsdp", "strategy.shard_units=[DecoderLayer]"])
    with pytest.raises(ConfigError, match="valid choices: DecoderLayer"):
        resolve(["model=llama_tiny", "strategy=fsdp", "strategy.shard_units=[Block]"])
    assert resolve(["model=gpt_tiny", "strategy=fsdp", "strategy.shard_units=[Block]"])
    with pytest.raises(ConfigError, match="valid choices: Block"):
        resolve(["model=gpt_tiny", "strategy=fsdp", "strategy.shard_units=[DecoderLayer]"])
    with pytest.raises(ConfigError, match="must divide model.n_head=4"):
        resolve(["model=gpt_tiny", "strategy=fsdp_tp", "hardware=cpu", "hardware.devices=3",
                 "strategy.tensor_parallel=3"])


@pytest.mark.parametrize("overrides,named", [
    (["strategy=nd", "strategy.tp=4"], "must divide model.n_kv_heads=2 (each tensor-parallel rank holds "
                                       "whole key/value heads); valid degrees: 1, 2"),
    (["strategy=fsdp_tp", "strategy.tensor_parallel=3"], "strategy.tensor_parallel=3: must divide "
                                                          "model.n_kv_heads=2 (each tensor-parallel rank holds "
                                                          "whole key/value heads); valid degrees: 1, 2"),
    (["strategy=nd", "strategy.pp=2"], "strategy.pp=2 puts the token embedding on the first pipeline stage and the "
                                       "head on the last, so a head tied to the embedding cannot be shared between "
                                       "them; set model.tie_embeddings=false"),
    (["strategy=nd", "strategy.pp=4"], "strategy.pp=4: exceeds model.n_layer=2"),
    (["model.n_kv_heads=3"], "model.n_kv_heads=3: must divide model.n_head=4 (each key/value head serves a whole "
                             "group of query heads); valid: 1, 2, 4"),
    (["model.vocab_size=200"], "model.vocab_size=200: is smaller than the data's vocabulary (dataset=tinycode "
                               "has token ids up to 255); set model.vocab_size=256"),
])
def test_layouts_and_shapes_llama_cannot_run_are_refused(overrides, named):
    with pytest.raises(ConfigError) as e:
        resolve(["model=llama_tiny", "hardware=h100x8", *overrides])
    assert named in str(e.value)


def test_llama_without_a_source_names_what_to_set():
    with pytest.raises(ConfigError, match="model=llama takes its shape from model.init_from's config.json"):
        resolve(["model=llama"])


def test_an_unsupported_architecture_names_the_supported_ones_and_the_fallback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    save_file({"wte.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        resolve(["model=llama", f"model.init_from={tmp_path}"])
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM" in msg
    assert f"model=hf_causal_lm model.config={tmp_path}" in msg


def test_a_checkpoint_of_another_shape_is_refused_listing_tensors(tmp_path):
    path = _hf_llama(tmp_path / "hf", tie=False, sharded=True)
    with pytest.raises(ConfigError) as e:
        resolve(["model=llama_tiny", f"model.init_from={path}"])
    msg = str(e.value)
    assert "does not fit model=llama_tiny" in msg
    assert "model.embed_tokens.weight [300, 64] in the file, [512, 128] in the model" in msg
    assert "1 tensor(s) the model does not have: lm_head.weight" in msg  # llama_tiny ties its head


def test_a_sized_option_must_agree_with_config_json_beyond_shapes(tmp_path):
    path = _hf_llama(tmp_path / "hf", tie=False, sharded=False)
    same_shape = ["model=llama_tiny", f"model.init_from={path}", "model.d_model=64", "model.intermediate_size=160",
                  "model.vocab_size=300", "model.tie_embeddings=false"]
    with pytest.raises(ConfigError) as e:
        resolve(same_shape)
    assert "model.rope_scaling=" in str(e.value) and "use model=llama" in str(e.value)
    scaling = "model.rope_scaling={factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,original_max_position_embeddings:16}"
    assert resolve([*same_shape, scaling]).model.init_from == str(path)


UNTIED = ["model=llama_tiny", "model.tie_embeddings=false"]
# llama_tiny's weights on one of 2 tensor-parallel ranks: q/k/v/gate/up keep half their output rows
# (q: 2 of 4 heads of 32, k and v: 1 of 2 key/value heads), o/down half their input columns.
TP2_LOCAL = {"self_attn.q_proj": (64, 128), "self_attn.k_proj": (32, 128), "self_attn.v_proj": (32, 128),
             "self_attn.o_proj": (128, 64), "mlp.gate_proj": (192, 128), "mlp.up_proj": (192, 128),
             "mlp.down_proj": (128, 192)}


def test_tp_plan_splits_every_linear_of_a_decoder_layer_by_whole_heads(fake_world_of_2):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from loom.models.init import params_on_meta
    from loom.models.llama.network import DecoderLayer
    from loom.strategies.model_parallel import _apply_tensor_parallel

    module = build_module(resolve(UNTIED))
    with params_on_meta():
        module.model = module.build_model()
    _apply_tensor_parallel(module, init_device_mesh("cpu", (2,)))
    plan = module.tensor_parallel_plan[DecoderLayer]
    for layer in module.model.model.layers:
        linears = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        assert linears == set(plan) == set(TP2_LOCAL)  # no Linear of a layer is left whole
        for name in sorted(linears):
            w = layer.get_submodule(name).weight
            assert isinstance(w, DTensor) and w.placements == (Shard(0 if plan[name] == "colwise" else 1),), name
            assert tuple(w.to_local().shape) == TP2_LOCAL[name], name
    body = module.model.model  # embedding, norms and head stay whole, as the GPT's (FSDP2 shards them)
    assert not any(isinstance(p, DTensor) for p in (body.embed_tokens.weight, body.norm.weight,
                                                    module.model.lm_head.weight))
    from loom.plan.memory import tp_replicated_params  # what the plan leaves whole is what TP does

    whole = sum(p.numel() for p in module.model.parameters() if not isinstance(p, DTensor))
    assert whole == tp_replicated_params(resolve(UNTIED))
    # attention runs on the rank's local heads (2 query, 1 key/value): shapes only, on meta
    logits = module.model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert tuple(logits.shape) == (2, 16, 512)


def test_pipeline_split_of_llama3_8b_into_4_stages_by_layers():
    from loom.models.init import params_on_meta
    from loom.plan.pipeline import stage_plans
    from loom.strategies import layout_of
    from loom.strategies.pipeline import split_stages

    cfg = resolve(["model=llama3_8b", "hardware=h100x8", "strategy=nd", "strategy.pp=4", "strategy.dp_shard=2"])
    plans = stage_plans(cfg, "nd", layout_of(cfg))
    module = build_module(cfg)
    for stage in range(4):
        with params_on_meta():
            net = module.build_model()
        total = sum(p.numel() for p in net.parameters())
        (chunk,) = split_stages(net, [stage], 4)
        body = net.model
        assert list(body.layers) == [str(i) for i in range(8 * stage, 8 * stage + 8)]
        assert [id(m) for m in chunk.layers] == [id(m) for m in body.layers.values()]
        assert (body.embed_tokens is not None) == (stage == 0)
        assert (body.norm is not None) == (net.lm_head is not None) == (stage == 3)
        assert body.rotary_emb is not None  # on every stage
        # the stage module holds every parameter the rank kept (FSDP2 shards it as the root)
        kept = sum(p.numel() for p in net.parameters())
        assert sum(p.numel() for p in chunk.parameters()) == kept < total
        assert plans[stage].params == kept, (stage, plans[stage].params, kept)  # the plan counts the same
        assert {net.pipeline_split.stage_of(k, lambda layer: layer // 8, 4) for k in net.state_dict()} == {stage}


@pytest.mark.parametrize("overrides", [UNTIED, ["model=gpt_tiny"]])
def test_two_pipeline_stages_compute_what_the_whole_network_does(overrides):
    from loom.strategies.pipeline import split_stages

    module = build_module(resolve(overrides))
    nets = []
    for _ in range(3):
        torch.manual_seed(0)  # the networks initialize themselves from torch's seed
        nets.append(module.build_model().eval())
    whole, a, b = nets
    (first,), (last,) = split_stages(a, [0], 2), split_stages(b, [1], 2)
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        h = first(x)
        assert h.shape == (2, 24, module.cfg.model.d_model)  # the first stage sends hidden states
        assert torch.equal(last(h), whole(x))


def test_plan_compare_lists_llama_tp_and_pp_layouts_and_why_a_tied_head_has_no_pp():
    from loom.compose import compose
    from loom.plan.compare import compare

    def layouts(*overrides: str):
        c = compare(compose(["hardware=cpu", "hardware.devices=4", *overrides]))
        return {(x.strategy, x.degrees["tp"], x.degrees["pp"]) for x in c.candidates}, c.refused

    untied, _ = layouts(*UNTIED)
    assert {("fsdp_tp", 2, 1), ("nd", 2, 2), ("nd", 1, 2)} <= untied
    tied, refused = layouts("model=llama_tiny")
    assert ("fsdp_tp", 2, 1) in tied and not any(pp > 1 for _, _, pp in tied)
    assert any("set model.tie_embeddings=false" in why for _, why in refused)


# ----------------------------------------------------------------------------- tokenizer-sized vocabularies


def _bpe_tokenizer(path: Path, size: int) -> Path:
    """A byte-level BPE tokenizer trained here on a few lines (no download), save_pretrained'd."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(400)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


@pytest.mark.parametrize("option", ["gpt_tiny", "llama_tiny"])
def test_a_tokenizer_sizes_the_vocabulary_padded_and_the_padding_never_changes_the_loss(tmp_path, option):
    from loom.data.tokenizer import tokenizer_vocab_size

    tok = _bpe_tokenizer(tmp_path / "tok", 700)
    used = tokenizer_vocab_size(str(tok))
    cfg = resolve([f"model={option}", f"dataset.tokenizer={tok}", *ONE_CPU])
    assert cfg.model.vocab_size % 64 == 0 and cfg.model.vocab_size - 64 < used < cfg.model.vocab_size
    assert cfg.model.vocab_used == used
    module = build_module(cfg)
    module.configure_model()
    torch.manual_seed(0)
    x, y = torch.randint(0, used, (2, 32)), torch.randint(0, used, (2, 32))
    with torch.no_grad():
        logits = module.model(x)
        logits[..., used:] += 50.0  # whatever the padded rows say, they are not in the softmax
        unpadded = torch.nn.functional.cross_entropy(logits[..., :used].reshape(-1, used), y.reshape(-1))
        assert abs(module._lm_loss(logits, y).item() - unpadded.item()) < 1e-6
        assert module._lm_loss(logits, y).item() < torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item() - 1.0  # the padding would have counted


def test_a_tokenizer_larger_than_a_published_vocabulary_is_refused(tmp_path):
    """A sized llama3_* option keeps Meta's vocabulary (here lowered to 512 so that a 700-token
    tokenizer exceeds it): it is not resized to the tokenizer but refused, naming both."""
    tok = _bpe_tokenizer(tmp_path / "tok", 700)
    with pytest.raises(ConfigError, match=r"model.vocab_size=512: is smaller than the data's vocabulary"):
        resolve(["model=llama3_1b", f"dataset.tokenizer={tok}", "model.vocab_size=512", *ONE_CPU])


def test_a_rank_filling_part_of_a_parameter_reads_only_the_rows_covering_it(tmp_path):
    """model.init_from under FSDP2 (rows) or ZeRO-3 (a flat range): FileInit reads the rows of
    the range with safetensors' get_slice, not the tensor; a whole value is read whole."""
    from safetensors import safe_open

    from loom.models.init import FileInit

    path = _hf_llama(tmp_path / "hf", tie=False, sharded=True)
    init = FileInit(str(path))
    name = "model.layers.1.mlp.up_proj.weight"  # (160, 64)
    with safe_open(str(init._where[name]), framework="pt") as f:
        whole = f.get_tensor(name).reshape(-1)
    shape, row = (160, 64), 64
    half = torch.empty(80 * row)
    init.fill_flat(half, name, shape, 80 * row)  # rank 1 of 2 under FSDP2: rows 80..159
    assert torch.equal(half, whole[80 * row:]) and init.elements_read == 80 * row
    odd = torch.empty(1000)
    init.fill_flat(odd, name, shape, 3 * row + 5)  # a ZeRO-3 partition starting mid-row
    assert torch.equal(odd, whole[3 * row + 5:3 * row + 1005])
    assert init.elements_read == 80 * row + 16 * row  # rows 3..18 cover elements 197..1196
    full = torch.empty(160 * row)
    init.fill_flat(full, name, shape, 0)
    assert torch.equal(full, whole) and init.elements_wanted == 160 * row
