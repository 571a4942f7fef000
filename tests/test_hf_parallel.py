"""TP and PP for any transformers decoder from its own config's plans (loom.models.hf.parallel).

The parity test spawns 4 gloo ranks once for all architectures (Llama, Qwen3, Mistral with and
without a sliding window, Gemma-2, Phi-3, OLMo-2) and compares each mode's per-step losses and
final weights with single-process float64 training: TP 2 with 2 micro-batches of gradient
accumulation (built on meta, materialized, then loaded), dp 2 x tp 2 with FSDP2, 1F1B over 2
stages, interleaved 1F1B over 4 stages on 2 ranks, and (Qwen3) 1F1B over 2 stages each
tensor-parallel (pp 2 x tp 2) or FSDP2-sharded (pp 2 x dp 2). The checks (torch-free) are tested
in-process, the meta-device local shapes on torch's fake process group.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loom.models.hf import parallel as P

# float64 throughout, 10 steps: per-step losses to 1e-10 relative (Gemma-2: 1e-8), final weights to 1e-10 of the tensor's largest
# entry. Gemma-2's RMSNorm computes in float32 (`x.float()`) whatever the model's dtype, so its norm weights'
# gradients are float32-accurate (single-process accumulation alone moves them ~1e-7): its weights get 1e-5.
LOSS_RTOL = 1e-10
# Gemma-2's float32 norms: over 10 steps its loss drifts to 2.6e-10 of the reference (step 9, tp with accumulation)
LOSS_RTOL_OF = {"gemma2": 1e-8}
WEIGHT_RTOL = {"gemma2": 1e-5}
WEIGHT_RTOL_DEFAULT = 1e-10

LLAMA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
              "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
              "layers.*.mlp.down_proj": "rowwise"}
PP_PLAN = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
           "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
           "norm": (["hidden_states"], ["hidden_states"])}


# --- the torch-free checks -------------------------------------------------------------------------------

def test_module_imports_neither_torch_nor_transformers():
    path = Path(P.__file__)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('hf_parallel', {str(path)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
            "assert m.tp_problem(None, 2, 4, 2) and m.TP_STYLES\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tp_problem_accepts_the_plans_of_the_supported_architectures():
    from hf_parallel_helpers import ARCHS, config

    for arch in ARCHS:
        cfg = config(arch)
        assert P.tp_problem(cfg.base_model_tp_plan, 2, 4, 2) is None, arch
    assert P.tp_problem(None, 1, 4, 2) is None  # tp 1 needs no plan


def test_tp_problem_without_a_plan():
    assert "declares no base_model_tp_plan" in P.tp_problem(None, 2, 4, 2)
    assert "declares no base_model_tp_plan" in P.tp_problem({}, 2, 4, 2)
    # top-level rules (an embedding's) are not applied: a plan of only those is no plan for Loom
    assert "declares no base_model_tp_plan" in P.tp_problem({"embed_tokens": "embedding_rowwise"}, 2, 4, 2)


def test_tp_problem_names_an_unsupported_style_and_its_module():
    plan = LLAMA_PLAN | {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                         "layers.*.mlp.experts": "moe_tp_experts"}
    msg = P.tp_problem(plan, 2, 4, 2)
    assert "'packed_colwise'" in msg and "'layers.*.mlp.experts.gate_up_proj'" in msg
    for style in ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                  "replicated_with_grad_allreduce"):
        assert style in msg
    assert "sequence_parallel" in P.tp_problem({"layers.*.norm": "sequence_parallel"}, 2, 4, 2)
    # an embedding's rule stays unapplied (embeddings stay whole), not refused
    assert P.tp_problem(LLAMA_PLAN | {"embed_tokens": "embedding_rowwise"}, 2, 4, 2) is None


def test_tp_problem_when_tp_does_not_divide_the_heads():
    msg = P.tp_problem(LLAMA_PLAN, 4, 8, 2)
    assert "tp=4" in msg and "key/value heads (2)" in msg and "valid tp values: [1, 2]" in msg
    assert "valid tp values: [1, 3]" in P.tp_problem(LLAMA_PLAN, 2, 9, 3)
    assert P.tp_problem(LLAMA_PLAN, 4, 8, 4) is None


def test_pp_problem_messages():
    assert "declares no base_model_pp_plan" in P.pp_problem(None, False, 4, 2)
    assert "model.overrides.tie_word_embeddings=false" in P.pp_problem(PP_PLAN, True, 4, 2)
    assert "3 decoder layers cannot fill 4 pipeline stages" in P.pp_problem(PP_PLAN, False, 3, 4)
    assert P.pp_problem(PP_PLAN, False, 4, 4) is None
    assert P.pp_problem(None, True, 1, 1) is None  # one stage: nothing to cut


def test_stage_layers_split_evenly_later_stages_taking_the_remainder():
    assert [list(P.stage_layers(s, 3, 7)) for s in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [list(P.stage_layers(s, 4, 4)) for s in range(4)] == [[0], [1], [2], [3]]


# --- in one process ----------------------------------------------------------------------------------------

def test_pipeline_split_names_from_the_pp_plan():
    from hf_parallel_helpers import build

    assert P.pipeline_split(build("llama")) == ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))


def test_pipeline_chunks_prune_and_compose_to_the_model():
    """All 4 stages on one rank: the kept names are the model's, pruned layers hold nothing, each chunk
    registers only its own modules, and the chunks in sequence compute the model's logits exactly
    (Gemma-2: embedding scaling, alternating sliding-window layers, soft-capping; each chunk runs only its own
    layers though the rank holds the others)."""
    from hf_parallel_helpers import batches, build

    for arch in ("gemma2", "phi3"):
        model, ref = build(arch), build(arch)
        chunks = P.pipeline_chunks(model, [0, 1, 2, 3], 4)
        names = {n for c in chunks for n, _ in c.named_parameters()}
        assert len(names) == len(dict(ref.named_parameters()))  # each parameter in exactly one chunk
        assert {n for n, _ in chunks[1].named_parameters()} == {
            n.replace("model.layers.1.", "layers.1.") for n, _ in ref.named_parameters() if ".layers.1." in n}
        x = batches()[0][0]
        h = x
        for c in chunks:
            h = c(h)
        assert torch.equal(h, ref(input_ids=x, use_cache=False).logits), arch

        pruned = build(arch)
        (chunk,) = P.pipeline_chunks(pruned, [1], 4)
        kept = {n for n, _ in pruned.named_parameters()}
        assert kept == {n for n, _ in ref.named_parameters() if ".layers.1." in n}  # same names, nothing else
        assert pruned.model.embed_tokens is None and pruned.lm_head is None and pruned.model.norm is None
        assert sum(1 for _ in pruned.model.layers[0].parameters()) == 0
        assert len(dict(chunk.named_parameters())) == len(kept)


def test_pipeline_chunks_under_activation_checkpointing_give_the_model_gradients():
    """Layers wrapped by torch's non-reentrant checkpoint_wrapper before the cut (as Loom applies activation
    checkpointing), or by transformers' own gradient checkpointing: the recompute in backward must see the
    activation the chunk fed in, not the stand-in zeros the model's forward passes."""
    from hf_parallel_helpers import batches, build, loss_fn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    x, y = batches()[0]
    ref = build("qwen3")
    loss_fn(ref(input_ids=x, use_cache=False).logits, y).backward()
    for how in ("torch", "transformers"):
        model = build("qwen3")
        if how == "torch":
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            model.activation_checkpointing_enable({"use_reentrant": False})
            model.train()
        h = x
        for c in P.pipeline_chunks(model, [0, 1], 2):
            h = c(h)
        loss_fn(h, y).backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=1e-10, atol=1e-14), (how, n)


# local shapes at tp 2 (hidden 64, 4 heads of 16, 2 kv heads, intermediate 128), by module in layer 0
META_LOCAL = {
    "phi3": {"self_attn.qkv_proj": ((128, 64), (64, 64)),   # fused q|k|v, colwise_gather_output
             "self_attn.o_proj": ((64, 64), (64, 32)), "mlp.gate_up_proj": ((256, 64), (128, 64)),
             "mlp.down_proj": ((64, 128), (64, 64))},
    "qwen3": {"self_attn.q_proj": ((64, 64), (32, 64)), "self_attn.k_proj": ((32, 64), (16, 64)),
              "self_attn.v_proj": ((32, 64), (16, 64)), "self_attn.o_proj": ((64, 64), (64, 32)),
              "mlp.gate_proj": ((128, 64), (64, 64)), "mlp.up_proj": ((128, 64), (64, 64)),
              "mlp.down_proj": ((64, 128), (64, 64))},
}


def test_tensor_parallel_on_a_meta_model_gives_local_shards(fake_world_of_2):
    from hf_parallel_helpers import build
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for arch, expect in META_LOCAL.items():
        model = build(arch, device="meta")
        n = P.apply_tensor_parallel(model, mesh)
        assert n == len(model.config.base_model_tp_plan) * 4, arch
        model.to_empty(device="cpu")
        layer = model.model.layers[0]
        for name, (full, local) in expect.items():
            w = layer.get_submodule(name).weight
            assert isinstance(w, DTensor) and w.device.type == "cpu", (arch, name)
            assert (tuple(w.shape), tuple(w.to_local().shape)) == (full, local), (arch, name)
        # whole on every TP rank: embedding, norms (Qwen3's q_norm / k_norm too), head
        for name, p in model.named_parameters():
            if "norm" in name or "embed" in name or "lm_head" in name:
                assert not isinstance(p, DTensor), name


def test_tensor_parallel_after_activation_checkpointing_and_the_pipeline_cut(fake_world_of_2):
    """Loom's order on the meta device: layers wrapped for activation checkpointing, the model cut to this
    rank's stage, then TP: the rules match through the wrapper and skip the pruned layers."""
    from hf_parallel_helpers import build
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = build("qwen3", device="meta")
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    P.pipeline_chunks(model, [1], 2)  # layers 2 and 3
    assert P.apply_tensor_parallel(model, init_device_mesh("cpu", (2,))) == 9 * 2
    assert all(k.startswith(("model.layers.2.", "model.layers.3.")) for k in P.expanded_tp_plan(model))
    q = model.model.layers[3]._checkpoint_wrapped_module.self_attn.q_proj.weight
    assert isinstance(q, DTensor) and tuple(q.to_local().shape) == (32, 64)


# --- 4 processes ---------------------------------------------------------------------------------------------

@pytest.mark.launch  # 4 training processes (spawned ranks, not `loom train`: nothing for the launch budget)
def test_parallel_training_matches_one_process(tmp_path):
    import torch.multiprocessing as mp
    from hf_parallel_helpers import ARCHS, MODES, PP_COMPOSED, TP_LAYERS, reference, worker

    context = mp.start_processes(worker, args=(4, str(tmp_path / "init"), str(tmp_path), ARCHS), nprocs=4,
                                 start_method="spawn", join=False)
    # the references, while the ranks run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the 4 ranks share the cores
    try:
        refs = {(arch, n): reference(arch, n) for arch in ARCHS for n in (TP_LAYERS, 4)}
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + 900  # a hung collective fails the test instead of hanging it
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.terminate()
                raise AssertionError("the 4 ranks did not finish within 900 s")
    except mp.ProcessRaisedException as e:
        raise AssertionError(str(e)) from None
    except mp.ProcessExitedException:
        errors = [torch.load(f, weights_only=False).get("traceback") for f in tmp_path.glob("*.pt")]
        raise AssertionError("\n".join(e for e in errors if e)) from None
    results = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(4)]
    for arch in ARCHS:
        rtol = WEIGHT_RTOL.get(arch, WEIGHT_RTOL_DEFAULT)
        for mode in MODES:
            ranks = [r for r in results if (arch, mode) in r]
            if mode in ("pp_tp", "pp_fsdp") and arch not in PP_COMPOSED:
                continue
            assert len(ranks) >= 2, (arch, mode)
            ref_losses, ref_weights = refs[arch, TP_LAYERS if mode in ("tp_accum", "dp_tp_fsdp") else 4]
            seen = set()
            for r in ranks:
                losses, weights = r[(arch, mode)]
                assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL_OF.get(arch, LOSS_RTOL), abs=0), (arch, mode)
                for name, w in weights.items():
                    ref = ref_weights[name]
                    assert (w - ref).abs().max() <= rtol * ref.abs().max(), (arch, mode, name)
                seen |= weights.keys()
            assert seen == set(ref_weights), (arch, mode)  # the stages' weights cover the model


# --- refused before launch, through `loom train` (in process) ----------------------------------------------

@pytest.fixture(scope="module")
def decoder_dirs(tmp_path_factory):
    """config.json dirs (no weights): a tiny Qwen3 (a tp and a pp plan, tied head), GPT-2 (no plans) and
    Qwen3-MoE (its experts' styles Loom does not apply)."""
    import transformers as t
    from hf_parallel_helpers import config

    d = tmp_path_factory.mktemp("decoders")
    qwen3 = config("qwen3")
    qwen3.tie_word_embeddings = True
    qwen3.save_pretrained(d / "qwen3")
    t.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=320, n_positions=64).save_pretrained(d / "gpt2")
    t.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     vocab_size=320, max_position_embeddings=64).save_pretrained(d / "moe")
    return d


HF = ["hardware=cpu", "model=hf_causal_lm", "dataset=synthetic", "dataset.vocab_size=96", "dataset.seq_len=32"]


@pytest.mark.parametrize("arch, args, words", [
    ("gpt2", ["strategy=fsdp_tp", "hardware.devices=2", "strategy.tensor_parallel=2"],
     ["GPT2Config) declares no base_model_tp_plan", "Use strategy=fsdp"]),
    ("gpt2", ["strategy=pp", "hardware.devices=2"], ["declares no base_model_pp_plan"]),
    ("moe", ["strategy=fsdp_tp", "hardware.devices=2", "strategy.tensor_parallel=2"],
     ["packed_colwise", "layers.*.mlp.experts.gate_up_proj", "which Loom does not apply"]),
    ("qwen3", ["strategy=fsdp_tp", "hardware.devices=4", "strategy.tensor_parallel=4"],
     ["strategy.tensor_parallel=4", "key/value heads (2)", "valid tp values: [1, 2]"]),
    ("qwen3", ["strategy=pp", "hardware.devices=2"], ["model.overrides.tie_word_embeddings=false"]),
])
def test_a_decoder_its_plans_cannot_split_is_refused_naming_why(decoder_dirs, tmp_path, arch, args, words):
    from conftest import refused

    text = refused(tmp_path, *HF, f"model.config={decoder_dirs / arch}", *args)
    for w in words:
        assert w in text, (w, text)


def test_an_untied_override_makes_the_pipeline_accepted(decoder_dirs):
    from loom.pipeline import resolve

    cfg = resolve([*HF, f"model.config={decoder_dirs / 'qwen3'}", "strategy=pp", "hardware.devices=2",
                   "model.overrides.tie_word_embeddings=false"])
    assert cfg.model.overrides.tie_word_embeddings is False
