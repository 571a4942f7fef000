"""`checkpoint.export_format=hf` (loom.rundir.hf_export): `final/` as a directory
`transformers.AutoModelForCausalLM.from_pretrained` loads, with the same logits as the model
Loom trained: Loom's Llama (tied, and untied with Qwen2's q/k/v biases) and a transformers model
run as `model=hf_causal_lm`; one file or shards with an index, the tokenizer's files beside.

In-process: the model is built as the worker builds it and its state dict is streamed through
the same writer the worker uses (`write_hf_dir`), tensor by tensor. The export of a trained run,
gathered under sharding, rides on the shared llama runs (tests/test_llama_runs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.models import build_module
from loom.models.hf.config import config_dict
from loom.models.llama.hf_config import config_from_fields
from loom.pipeline import resolve
from loom.rundir.hf_export import INDEX, plan_shards, write_hf_dir
from loom.rundir.safetensors_stream import dtype_name, tensor_bytes

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single"]


def _built(*overrides: str):
    cfg = resolve([*overrides, *ONE_CPU])
    module = build_module(cfg)
    module.configure_model()
    torch.manual_seed(0)
    with torch.no_grad():  # away from the init values (norm weights of 1, zero biases)
        for p in module.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, module.model.eval()


def _export(model, out: Path, config: dict, max_bytes: float, tokenizer_dir=None) -> list[Path]:
    state = model.state_dict()
    specs = [(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in state.items()]
    return write_hf_dir(out, config, specs, iter(state.items()), {"run_id": "test"}, max_bytes, tokenizer_dir)


def _same_logits(model, out: Path, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.manual_seed(1)
    x = torch.randint(0, vocab, (2, 48))
    with torch.no_grad():
        want = model(x)
        got = hf(x).logits
    want = want.logits if hasattr(want, "logits") else want
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("overrides,arch", [
    ([], "LlamaForCausalLM"),  # tied head, Llama-3.1 rotary scaling
    (["model.qkv_bias=true", "model.tie_embeddings=false"], "Qwen2ForCausalLM"),
])
def test_llama_exports_a_directory_transformers_loads_with_the_same_logits(tmp_path, overrides, arch):
    cfg, model = _built("model=llama_tiny", *overrides)
    max_bytes = 150_000  # several shards of llama_tiny's ~1.8 MB
    paths = _export(model, tmp_path / "final", config_from_fields(cfg.model), max_bytes)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["architectures"] == [arch]
    index = json.loads((tmp_path / "final" / INDEX).read_text())
    shards = sorted(p.name for p in paths if p.name.endswith(".safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(model.state_dict())
    _same_logits(model, tmp_path / "final", int(cfg.model.vocab_size))


def test_the_config_carries_integer_fields_as_integers_and_loads_without_a_type_warning(tmp_path):
    """The model schema holds llama3 rotary scaling as floats; config.json wrote
    `original_max_position_embeddings: 8192.0` and transformers warned on every load. Every field
    LlamaConfig holds as an integer is one in the file, and from_pretrained logs no type warning."""
    import logging

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg, model = _built("model=llama_tiny")
    _export(model, tmp_path / "final", config_from_fields(cfg.model), 1e9)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert type(config["rope_scaling"]["original_max_position_embeddings"]) is int, config["rope_scaling"]
    defaults = LlamaConfig().to_dict()
    ints = sorted(k for k in config if type(defaults.get(k)) is int)
    assert {"hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"} <= set(ints)
    assert [k for k in ints if type(config[k]) is not int] == []
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert logged == []  # no type warning, nor any other (llama_tiny's scaling fits its own context)


def test_hf_causal_lm_exports_its_own_architecture_and_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=128, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path / "gpt2")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    cfg, model = _built("model=hf_causal_lm", f"model.config={tmp_path / 'gpt2'}", "model.random_init=true")
    paths = _export(model, tmp_path / "final", config_dict(cfg.model), 1e9, tmp_path / "tok")
    names = {p.name for p in paths}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not (tmp_path / "final" / INDEX).exists()  # one shard: no index, as save_pretrained
    _same_logits(model, tmp_path / "final", 300)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "final")("w3 w7")["input_ids"] == [3, 7]


def test_shards_keep_the_order_and_the_bound_and_a_big_tensor_stands_alone():
    specs = [("a", (10,), "float32"), ("b", (20,), "float32"), ("big", (100,), "float32"), ("c", (5,), "bfloat16")]
    shards = plan_shards(specs, max_bytes=120)
    assert [[s[0] for s in shard] for shard in shards] == [["a", "b"], ["big"], ["c"]]
    assert all(sum(tensor_bytes(s) for s in shard) <= 120 for shard in shards if len(shard) > 1)
    assert plan_shards(specs, max_bytes=1e9) == [specs]


def test_a_re_export_leaves_no_shard_of_the_previous_one(tmp_path):
    cfg, model = _built("model=llama_tiny")
    _export(model, tmp_path / "final", config_from_fields(cfg.model), 150_000)
    _export(model, tmp_path / "final", config_from_fields(cfg.model), 1e9)
    assert sorted(p.name for p in (tmp_path / "final").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "final" / INDEX).exists()
    _same_logits(model, tmp_path / "final", int(cfg.model.vocab_size))


@pytest.mark.parametrize("overrides,named", [
    (["checkpoint.export_format=hf"], "model=gpt_tiny has no Hugging Face architecture"),
    (["checkpoint.export_format=onnx", "model=llama_tiny"], "valid choices: loom, hf"),
    (["checkpoint.export_format=hf", "model=llama_tiny", "checkpoint.export_shard_gb=0"], "must be > 0"),
])
def test_an_export_loom_cannot_write_is_refused_before_launch(overrides, named):
    from loom.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        resolve([*overrides, *ONE_CPU])
