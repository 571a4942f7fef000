"""`model=hf_causal_lm` checked against its architecture before launch: `model.overrides`' keys
and types against the config class (config.json + the class's defaults), the model built on the
meta device, and the weights `model.config`'s directory brings implicitly (its safetensors,
loaded unless `model.random_init=true`) against the model's shapes, read from the files'
headers. These need transformers (which imports torch), so they run for this option only and
after its torch-free checks: every other option keeps the CLI's first second torch-free.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.errors import ConfigError
from loom.errors import fail as _fail
from loom.models.family import Shapes
from loom.models.hf import config as hf

MAX_REASON = 300  # characters of a transformers exception quoted in a refusal


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:MAX_REASON]}"


def _key(m: DictConfig) -> str:
    """The model node as a cache key (config.json's mtime too: a rewritten file is another model)."""
    f = hf._local_file(str(m.config), "config.json")
    stamp = f.stat().st_mtime_ns if f is not None else None
    return json.dumps([OmegaConf.to_container(m) if isinstance(m, DictConfig) else m, stamp], default=str)


@functools.lru_cache(maxsize=32)
def _base(key: str) -> Any:
    return hf.base_config(OmegaConf.create(json.loads(key)[0]))


@functools.lru_cache(maxsize=32)
def _shapes(key: str) -> Shapes:
    return hf.parameter_shapes(OmegaConf.create(json.loads(key)[0]))


def base_config(m: DictConfig) -> Any:
    """transformers' config of `model.config`; unreadable: exit 2 naming model.config."""
    try:
        return _base(_key(m))
    except Exception as e:  # an unknown model_type, a malformed file: transformers' words
        _fail("model.config", m.config, f"transformers cannot read its config.json ({_reason(e)}); "
              "name a directory saved by save_pretrained of an architecture this transformers knows")


def canonical_overrides(cfg: DictConfig) -> None:
    """An alias in `model.overrides` (GPT-2's num_hidden_layers) becomes the key it stands for
    (n_layer), so config.json's reading (`hf.config_dict`: context, vocabulary, widths) and the
    run id see one key; a key given both ways keeps the real key's value."""
    m = cfg.model
    overrides = hf.overrides_of(m) if m.config else {}
    if not overrides:
        return
    try:
        aliases = hf.config_keys(_base(_key(m)))[1]
    except Exception:
        return  # the check names model.config
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        out.setdefault(aliases.get(k, k), v)
        if k not in aliases:
            out[k] = v
    m.overrides = out


def _type_problem(default: Any, value: Any) -> str | None:
    """What `value` should be, where the config's own value says a type (None: no type known)."""
    if default is None or value is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "a boolean (true/false)"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "a number"
    for typ, what in ((str, "a string"), (list, "a list"), (dict, "a mapping")):
        if isinstance(default, typ):
            return None if isinstance(value, typ) else what
    return None


def check_overrides(m: DictConfig, config: Any) -> None:
    """Every key of `model.overrides` is one of the config class's (or an alias of one), of the
    type the config's own value has."""
    keys, aliases = hf.config_keys(config)
    cls = type(config).__name__
    for k, v in hf.overrides_of(m).items():
        if k not in keys and k not in aliases:
            alias_list = ", ".join(f"{a} (= {t})" for a, t in aliases.items())
            raise ConfigError(
                f"Invalid config: unknown key model.overrides.{k}={v}. Valid keys under model.overrides "
                f"({cls}'s: model.config's config.json and the class's defaults): {', '.join(keys)}"
                + (f"; aliases: {alias_list}" if alias_list else "") + ".")
        default = getattr(config, k, None)
        want = _type_problem(default, v)
        if want:
            _fail(f"model.overrides.{k}", v, f"{cls}.{aliases.get(k, k)} is {want} (model.config's value: "
                  f"{default!r})")


def model_shapes(m: DictConfig) -> Shapes:
    """The parameters' shapes of the model built on the meta device; a config transformers cannot
    build (say, heads that do not divide the width): exit 2 naming the overrides or model.config."""
    try:
        return _shapes(_key(m))
    except Exception as e:
        overrides = hf.overrides_of(m)
        key, value = ("model.overrides", overrides) if overrides else ("model.config", m.config)
        arch = ", ".join(base_config(m).architectures or []) or "a causal LM"
        _fail(key, value, f"transformers cannot build {arch} from model.config={m.config}"
              + (" with these overrides" if overrides else "") + f" ({_reason(e)}); "
              + ("change or remove the overrides" if overrides else "fix its config.json"))
    raise AssertionError  # unreachable: _fail raises


def file_shapes(path: Path) -> Shapes:
    """Names and shapes of the tensors in a directory's safetensors (headers only, no torch)."""
    from loom.models.init_from import read_header, tensor_files

    shapes: Shapes = {}
    for f in sorted(set(tensor_files(path).values())):
        shapes |= {k: tuple(v["shape"]) for k, v in read_header(f).items()}
    return shapes


def _misfits(expected: Shapes, found: Shapes) -> list[str]:
    """Shape mismatches and parameters missing from the file (tensors the model lacks are not
    read: a model with fewer layers than its file is a choice)."""
    from loom.models.init_from import mismatches

    return mismatches(expected, {k: v for k, v in found.items() if k in expected})


def fits_weights(cfg: DictConfig, overrides: dict[str, Any]) -> bool:
    """Whether `model.config`'s own weights fit the model built with these overrides."""
    path = hf.safetensors_dir(cfg.model)
    try:
        return path is None or not _misfits(_shapes(_key(_with(cfg.model, overrides=overrides))), file_shapes(path))
    except Exception:
        return False


def check_weights(cfg: DictConfig, shapes: Shapes) -> None:
    """`model.config`'s own safetensors, which the worker loads unless model.random_init=true (or
    model.init_from names other weights), fit the model: else exit 2 naming what changed them and
    the settings that fit."""
    m = cfg.model
    path = None if m.get("init_from") else hf.safetensors_dir(m)
    if path is None:
        return
    try:
        found = file_shapes(path)
    except (OSError, ValueError) as e:
        _fail("model.config", m.config, f"its weights are not readable safetensors ({e}); set "
              "model.random_init=true to start from random weights")
    problems = _misfits(shapes, found)
    if not problems:
        return
    key, value, cause, fixes = _culprit(cfg, found)
    raise ConfigError(
        f"Invalid config: {key}={value!r}: the weights in model.config={m.config} (loaded because "
        f"model.random_init=false) do not fit the model{cause}: {'; '.join(problems)}. "
        f"{'; or '.join(['Set model.random_init=true to start from random weights', *fixes])}.")


def _culprit(cfg: DictConfig, found: Shapes) -> tuple[str, Any, str, list[str]]:
    """(the key that made the shapes differ, its value, why, the other settings under which the
    weights fit), found by building the model again with the config's vocabulary, or without
    the overrides."""
    from loom.data import data_vocab_size

    m = cfg.model
    overrides = hf.overrides_of(m)
    base_vocab = int(getattr(base_config(m), "vocab_size", 0) or 0)
    if m.vocab_size is not None and int(m.vocab_size) != base_vocab:
        need = data_vocab_size(cfg)
        fixes = []
        if (need is None or need <= base_vocab) and not _misfits(model_shapes(_with(m, vocab_size=None)), found):
            fixes.append(f"leave model.vocab_size unset (null: the weights' {base_vocab} tokens)")
        cause = (f" (the vocabulary changes from the weights' {base_vocab} tokens to {int(m.vocab_size)}: "
                 "new rows have no pretrained values)")
        return "model.vocab_size", int(m.vocab_size), cause, fixes
    if overrides and not _misfits(model_shapes(_with(m, overrides={})), found):
        return "model.overrides", overrides, " (the overrides change its shapes)", [
            f"remove model.overrides ({', '.join(overrides)}): model.config's own shapes fit its weights"]
    return "model.config", m.config, "", []


def _with(m: DictConfig, **values: Any) -> DictConfig:
    out = OmegaConf.create(OmegaConf.to_container(m))
    for k, v in values.items():
        out[k] = v
    return out


def check_architecture(cfg: DictConfig) -> None:
    """The overrides against the config class, the build, then the implicit weights."""
    m = cfg.model
    check_overrides(m, base_config(m))
    check_weights(cfg, model_shapes(m))


def check_head(cfg: DictConfig, data: dict[str, Any], layout: Any) -> None:
    """`model.head`: a head Loom knows, that transformers has for this architecture (score:
    a `...ForSequenceClassification`), on a layout it trains under (score: no tp, no pp, as its
    head sits outside the architecture's tensor- and pipeline-parallel plans)."""
    from loom.models.heads import HEADS

    m = cfg.model
    head = str(m.get("head") or "lm")
    if head not in HEADS:
        _fail("model.head", head, "valid choices: " + "; ".join(f"{k}: {h.summary}" for k, h in HEADS.items()))
    if not HEADS[head].own:  # the causal LM's own head
        return
    model_type = data.get("model_type")
    if HEADS[head].class_name(model_type) is None:
        _fail("model.head", head, f"transformers has no {HEADS[head].auto_class.removeprefix('AutoModel')} class "
              f"for model.config={m.config} (model_type {model_type!r}); choose an architecture that has one "
              "(Llama, Qwen2, Mistral, GPT-2, ...) or model.head=lm")
    tp_key = "strategy.tp" if "tp" in cfg.strategy else "strategy.tensor_parallel"
    for key, what, size in ((tp_key, "tensor", layout.tp), ("strategy.pp", "pipeline", layout.pp)):
        if size > 1:
            _fail(key, size, f"model.head={head} trains with data parallelism only (single, ddp, fsdp, zero*): "
                  f"its head is outside the architecture's {what}-parallel plan; set {key}=1")


def pad_token_id(cfg: DictConfig, data: dict[str, Any]) -> int | None:
    """The id transformers' sequence-classification pooling skips as padding: the run's tokenizer's
    pad token, else its eos (a rendered conversation ends in it, unpadded), else config.json's."""
    from loom.data.tokenizer import TokenizerUnavailable, load_tokenizer

    name = cfg.dataset.get("tokenizer")
    ids: list[Any] = [data.get("pad_token_id"), data.get("eos_token_id")]
    if name:
        try:
            tok = load_tokenizer(str(name))
            ids = [tok.pad_token_id, tok.eos_token_id, *ids]
        except TokenizerUnavailable:
            pass
    for i in ids:
        i = i[0] if isinstance(i, list) and i else i
        if isinstance(i, int):
            return i
    return None


def export_config(cfg: DictConfig) -> dict[str, Any]:
    """config.json of the run's Hugging Face export: model.config's with the overrides; a
    `model.head=score` run's as transformers' `...ForSequenceClassification` (architectures,
    num_labels=1, pad_token_id), which AutoModelForSequenceClassification loads."""
    from loom.models.heads import head_of

    data = hf.config_dict(cfg.model)
    head = head_of(cfg.model)
    if not head.own:
        return data
    return {**data, "architectures": [head.class_name(data.get("model_type"))], "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": pad_token_id(cfg, data)}


def context_problem(cfg: DictConfig) -> str | None:
    """Why this transformers decoder cannot split its sequences over `strategy.cp` ranks (None: it can,
    Ulysses through its AttentionInterface, `models/hf/context.py`)."""
    from loom.models.hf import config as hf

    s, m = cfg.strategy, cfg.model
    if s.get("cp_style", "ulysses") == "ring":
        return "ring attention wraps Loom's own attention modules; use strategy.cp_style=ulysses"
    if s.get("pp", 1) != 1:
        return "its pipeline stages run transformers' layers without this rank's positions; use strategy.pp=1"
    if m.get("head", "lm") != "lm":
        return f"model.head={m.head} scores a sequence at its last token, which one rank's slice does not hold"
    config = hf.auto_config(m)
    text = config.get_text_config()
    cls = type(hf.meta_model(m))
    if not getattr(cls, "_supports_attention_backend", False):
        return f"{cls.__name__}'s attention does not go through transformers' AttentionInterface"
    window = getattr(text, "sliding_window", None)
    on = getattr(text, "use_sliding_window", True) or any("sliding" in str(t) for t in getattr(text, "layer_types", None) or [])
    seq = int(cfg.dataset.seq_len)
    if window and on and int(window) < seq:  # a window as long as the sequence is plain causal attention
        return (f"its sliding-window attention (sliding_window={window} < dataset.seq_len={seq}) is more than the "
                "causal attention Ulysses runs over the whole sequence")
    if getattr(text, "attn_logit_softcapping", None):
        return "its attention logits are soft-capped, which SDPA (Ulysses' attention) cannot do"
    return None
