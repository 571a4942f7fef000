"""`model=hf_causal_lm` configured as documented (conf/model/hf_causal_lm.yaml): `model.overrides`
in every syntax, checked against the architecture's config class before launch, and the weights a
`model.config` directory brings checked against the model's shapes before launch. In-process
(`loom plan` / `loom train` refused before launch): no training launch.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from conftest import refused
from tests_helpers import make_hf_config, make_tokenizer

from loom.models import model_spec
from loom.pipeline import resolve

DATA = ["dataset=synthetic", "dataset.seq_len=32", "dataset.vocab_size=256"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer (300 tokens), a weightless GPT-2 config (vocabulary 300), a GPT-2 with its
    safetensors (vocabulary 256, 2 layers, width 32, 64 positions) and a weightless Llama config."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

    d = tmp_path_factory.mktemp("hf_config")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64,
                               bos_token_id=1, eos_token_id=1)).save_pretrained(d / "gpt2w")
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(d / "llama")
    return {"tok": make_tokenizer(d / "tok"), "cfg": make_hf_config(d / "cfg", vocab_size=300), "gpt2w": d / "gpt2w",
            "llama": d / "llama", "root": d}


def planned(root: Path, *args: str) -> str:
    """`loom plan <args>` in this process: exit 0 (validated and planned); its stdout + stderr."""
    from loom import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["plan", *args])
    assert rc == 0, err.getvalue()
    return out.getvalue() + err.getvalue()


@pytest.mark.parametrize("override", [
    "model.overrides={n_layer: 1}",         # the YAML's documented form
    "model.overrides.n_layer=1",            # a key without `+`: Hydra's struct mode refused it
    "+model.overrides.n_layer=1",
    "++model.overrides.n_layer=1",
    "model.overrides.num_hidden_layers=1",  # GPT-2's alias, frozen as its own key
    "model.overrides={num_hidden_layers: 1}",
])
def test_overrides_in_every_documented_syntax_reach_the_model(hf_dirs, override):
    """Mutations caught: compose no longer opens `dict[str, Any]` fields (exit 2, 'Valid keys under
    model.overrides: .'); aliases not canonicalized (overrides would read {num_hidden_layers: 1});
    the overrides not applied to the built model (2 layers counted)."""
    args = ["model=hf_causal_lm", f"model.config={hf_dirs['gpt2w']}", *DATA, override]
    cfg = resolve(args)
    assert dict(cfg.model.overrides) == {"n_layer": 1}
    assert model_spec(cfg).layers == 1
    assert "│ model" in planned(hf_dirs["root"], *args)


def test_overrides_of_another_option_are_refused_naming_its_keys(hf_dirs):
    """`model.overrides` under gpt_tiny: refused by gpt_tiny's schema, which names its keys."""
    err = refused(hf_dirs["root"], "model.overrides.n_layer=1")
    assert "unknown key model.overrides" in err and "n_layer, n_head" in err


def test_an_unknown_override_key_names_the_config_class_keys(hf_dirs):
    """Mutation caught: keys not checked against the config class (the plan then built the model
    with a stray attribute, or transformers raised later)."""
    err = refused(hf_dirs["root"], "model=hf_causal_lm", f"model.config={hf_dirs['gpt2w']}", *DATA,
                  "model.overrides.n_layers=1")
    assert err.startswith("Invalid config: unknown key model.overrides.n_layers=1. Valid keys under "
                          "model.overrides (GPT2Config's"), err
    for key in ("n_layer", "n_embd", "n_positions", "layer_norm_epsilon", "vocab_size", "num_hidden_layers (= n_layer)"):
        assert key in err, key
    assert len(err.strip().splitlines()) == 1
    err = refused(hf_dirs["root"], "model=hf_causal_lm", f"model.config={hf_dirs['llama']}", *DATA,
                  "model.overrides={n_layer: 1}")  # Llama's class has other keys (its defaults included)
    assert "LlamaConfig's" in err and "num_key_value_heads" in err and "rms_norm_eps" in err


@pytest.mark.parametrize(("override", "needles"), [
    ("model.overrides.n_layer=two", ["model.overrides.n_layer='two'", "GPT2Config.n_layer is an integer"]),
    ("model.overrides.n_head=3", ["model.overrides={'n_head': 3}", "transformers cannot build GPT2LMHeadModel",
                                  "divisible", "change or remove the overrides"]),
])
def test_an_override_transformers_cannot_build_is_refused_not_a_traceback(hf_dirs, override, needles):
    """Mutation caught: the meta build's exception escaping validation (the 30-line traceback
    `loom plan` printed); a wrong type reaching transformers."""
    err = refused(hf_dirs["root"], "model=hf_causal_lm", f"model.config={hf_dirs['gpt2w']}", *DATA,
                  "model.random_init=true", override)
    for needle in needles:
        assert needle in err, (needle, err)


def test_the_implicit_weights_of_model_config_are_checked_before_launch(hf_dirs):
    """The directory's own safetensors (read when model.random_init=false) against the model's
    shapes, from the file's header: a new vocabulary or a wider model is refused naming the key,
    the tensors and model.random_init=true; a shallower model reads the layers it has. Mutation
    caught: no header check (the ranks failed in FileInit after launch), extra file tensors
    counted as a misfit (a 1-layer model of a 2-layer file refused)."""
    base = ["model=hf_causal_lm", f"model.config={hf_dirs['gpt2w']}", *DATA]
    err = refused(hf_dirs["root"], *base, "model.vocab_size=300")
    assert err.startswith("Invalid config: model.vocab_size=300: the weights in model.config=")
    assert "transformer.wte.weight [256, 32] in the file, [300, 32] in the model" in err
    assert "Set model.random_init=true" in err and "leave model.vocab_size unset" in err
    err = refused(hf_dirs["root"], *base, "model.overrides.n_embd=64")
    assert "model.overrides={'n_embd': 64}" in err and "28 shape mismatch(es)" in err
    assert "remove model.overrides (n_embd)" in err
    planned(hf_dirs["root"], *base, "model.overrides.n_layer=1")
    planned(hf_dirs["root"], *base, "model.vocab_size=300", "model.random_init=true")


def test_attention_flops_follow_each_layers_window_and_head_dim(tmp_path):
    """issue 39, counted correctly: 12 * Q * (the keys each layer attends over) per token, Q = heads x
    head_dim. Mistral with a window of 16 at seq_len 64 attends 16 keys per layer; Gemma-2 alternates
    sliding and full layers (layer_types) and its head_dim (32) is not hidden_size / heads (16)."""
    from transformers import Gemma2Config, MistralConfig

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    MistralConfig(**shape, sliding_window=16).save_pretrained(tmp_path / "mistral")
    MistralConfig(**shape, sliding_window=None).save_pretrained(tmp_path / "mistral-full")
    Gemma2Config(**shape, head_dim=32, sliding_window=16).save_pretrained(tmp_path / "gemma2")

    def spec(name: str):
        return model_spec(resolve(["model=hf_causal_lm", f"model.config={tmp_path / name}", "model.random_init=true",
                                   "dataset=synthetic", "dataset.seq_len=64", "dataset.vocab_size=256"]))

    full, windowed, gemma = spec("mistral-full"), spec("mistral"), spec("gemma2")
    assert full.params == windowed.params
    assert full.flops_per_token - windowed.flops_per_token == 12 * (4 * 16) * 4 * (64 - 16)
    n = gemma.matmul_params
    assert gemma.flops_per_token == 6 * n + 12 * (4 * 32) * (2 * 16 + 2 * 64)


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_llama_is_placed_as_loom_places_its_own(tmp_path, tied):
    """The plan's parts of a transformers decoder come from its meta build and its own TP plan: for a
    Llama config they are Loom's Llama family's (a layer, what TP leaves whole, the first and last
    stages, the largest parameter, the activation coefficients), and the counts are the same."""
    from transformers import LlamaConfig

    from loom.models import model_parts

    LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied).save_pretrained(tmp_path)
    common = ["hardware=cpu", "dataset=synthetic", "dataset.vocab_size=300", "dataset.seq_len=64"]
    hf = resolve([*common, "model=hf_causal_lm", f"model.config={tmp_path}", "model.random_init=true"])
    native = resolve(
        [*common, "model=llama_tiny", "model.n_layer=3", "model.n_head=4", "model.n_kv_heads=2", "model.d_model=64",
         "model.intermediate_size=160", "model.vocab_size=320", f"model.tie_embeddings={str(tied).lower()}"])
    assert model_parts(hf) == model_parts(native)
    assert model_spec(hf).params == model_spec(native).params
