"""`model=hf_causal_lm`: a transformers causal LM from a config available locally.

`model.config` is a directory holding config.json (save_pretrained) or a name already in the
Hugging Face cache; nothing is downloaded (local_files_only=True). Random initialization
(AutoModelForCausalLM.from_config) unless the weights are local too and
`model.random_init=false`. Validation reads config.json as JSON first (its refusals torch-free),
then checks the overrides and those weights against transformers' config class (`hf_checks`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.models.heads import head_of

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _local_file(name: str, filename: str) -> Path | None:
    from loom.data.tokenizer import _cached_file

    return _cached_file(name, filename)


def overrides_of(m: DictConfig) -> dict[str, Any]:
    """`model.overrides` as a plain dict (Hydra gives a DictConfig; a test may give a dict)."""
    if isinstance(m.overrides, DictConfig):
        return OmegaConf.to_container(m.overrides)  # type: ignore[return-value]
    return dict(m.overrides or {})


def config_dict(m: DictConfig) -> dict[str, Any]:
    """config.json of `model.config` with `model.overrides` and `model.vocab_size` applied."""
    f = _local_file(str(m.config), "config.json")
    if f is None:
        raise FileNotFoundError(m.config)
    data = json.loads(f.read_text())
    data.update(overrides_of(m))
    if m.vocab_size is not None:
        data["vocab_size"] = int(m.vocab_size)
    return data


def context_key(data: dict[str, Any]) -> str | None:
    """The config.json key holding the model's longest sequence."""
    return next((key for key in CONTEXT_KEYS if isinstance(data.get(key), int)), None)


def context_length(data: dict[str, Any]) -> int | None:
    key = context_key(data)
    return data[key] if key else None


def has_local_weights(name: str) -> bool:
    return any(_local_file(name, w) is not None for w in WEIGHT_FILES)


def safetensors_dir(m: DictConfig) -> Path | None:
    """The directory holding `model.config`'s pretrained safetensors weights (one file or an
    index of shards), which Loom reads itself, shard by shard (models.init.FileInit); None when
    the model starts from a random init or its weights are only `.bin` files."""
    if m.random_init:
        return None
    for name in ("model.safetensors.index.json", "model.safetensors"):
        f = _local_file(str(m.config), name)
        if f is not None:
            return f.parent
    return None


def loads_whole(m: DictConfig) -> bool:
    """Whether transformers' from_pretrained loads the weights, whole on every rank: pretrained
    `.bin` files only (safetensors Loom reads itself, each rank its own part)."""
    return not m.random_init and has_local_weights(str(m.config)) and safetensors_dir(m) is None


def zero3_problem(m: DictConfig) -> tuple[str, str] | None:
    """(the key, why ZeRO-3 cannot start this model), None when it can. Pretrained `.bin` weights load through
    transformers' from_pretrained, whole, into modules zero.Init has already partitioned (empty);
    Loom reads safetensors itself, each rank its own partition."""
    if not loads_whole(m):
        return None
    return "model.config", (
        "holds only .bin weights, which ZeRO-3 cannot load into its partitions; save them as safetensors once "
        "(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)), or train "
        "them with strategy=fsdp, or start from scratch with model.random_init=true")


def _source(m: DictConfig) -> str:
    p = Path(str(m.config)).expanduser()
    return str(p) if p.is_dir() else str(m.config)


def base_config(m: DictConfig):
    """transformers' config of `model.config` as saved (its class's defaults + config.json),
    before Loom's overrides: the keys `model.overrides` may set (imports transformers)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_source(m), local_files_only=True)


def auto_config(m: DictConfig):
    """The config the model is built from: `base_config` + `model.overrides` + `model.vocab_size`
    + what `model.head` sets (score: num_labels=1)."""
    config = base_config(m)
    for k, v in {**overrides_of(m), **head_of(m).config}.items():
        setattr(config, k, v)
    if m.vocab_size is not None:
        config.vocab_size = int(m.vocab_size)
    return config


def model_class(m: DictConfig):
    """transformers' Auto class of `model.head` (AutoModelForCausalLM, AutoModelForSequenceClassification)."""
    import transformers

    return getattr(transformers, head_of(m).auto_class)


def meta_model(m: DictConfig):
    """The network built on the meta device (shapes and counts only)."""
    import torch

    with torch.device("meta"):
        return model_class(m).from_config(auto_config(m))


def config_keys(config: Any) -> tuple[list[str], dict[str, str]]:
    """(the keys of the config class: config.json's and the class's defaults, its aliases ->
    the key each stands for), e.g. GPT-2's num_hidden_layers -> n_layer."""
    keys = sorted(k for k in config.to_dict() if not k.startswith("_"))
    return keys, dict(sorted(getattr(config, "attribute_map", {}).items()))


def parameter_shapes(m: DictConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape (a tied one once, under its first name, as the weights are
    filled), from the model built on the meta device (imports torch): those a causal LM's weights
    fill, so a `model.head=score` head (drawn, never read) is left out."""
    head = head_of(m)
    return {name: tuple(p.shape) for name, p in meta_model(m).named_parameters() if not head.owns(name)}


def build(m: DictConfig):
    """The architecture with its weights left to Loom's initializer (loom.models.init: by name,
    the same under every strategy); with pretrained `.bin` weights only (no safetensors for
    Loom to shard-load), transformers' from_pretrained, whole.

    transformers' own init (`_init_weights`) is skipped: Loom overwrites every parameter, and
    under `deepspeed.zero.Init` the parameters are already partitioned (empty on this rank)
    when it runs, so `embed.weight[padding_idx] = 0` (Gemma 2, Phi-3) raised IndexError."""
    config, auto = auto_config(m), model_class(m)
    if loads_whole(m):
        return auto.from_pretrained(_source(m), config=config, local_files_only=True)
    with _no_init_weights():
        model = auto.from_config(config)
    model.tie_weights()  # transformers 5 ties inside the init it skipped
    return model


def _no_init_weights():
    """transformers' context that skips weight init (and torch.nn.init) while building."""
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def attention_spans(m: DictConfig, seq_len: int) -> tuple[int, list[int]]:
    """(query width = heads x head_dim, the keys each layer's queries attend over: `seq_len`, or
    its sliding window where the config has one for that layer: `layer_types` naming
    `sliding_attention` (Gemma-2/3, Qwen3, ...), else `sliding_window` on every layer unless
    `use_sliding_window` is false (Mistral; Qwen2 off by default)). The FLOP count's attention
    term follows them: a windowed layer's scores and values cost its window, not the sequence."""
    config = auto_config(m)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    width = int(getattr(config, "hidden_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (width // heads if heads else 0))
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        windowed = [t == "sliding_attention" for t in types[:layers]]
    else:
        windowed = [bool(window) and getattr(config, "use_sliding_window", True) is not False] * layers
    return heads * head_dim, [min(seq_len, int(window)) if w and window else seq_len for w in windowed]


def count(m: DictConfig) -> tuple[int, int, int, int, bool]:
    """(params, embedding params, layers, width, tied head) of the model, built on the meta device."""
    config = auto_config(m)
    model = meta_model(m)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    embedding = emb.numel() + sum(p.numel() for n, p in model.named_parameters()
                                  if ("wpe" in n or "position" in n) and p.dim() == 2)
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    width = int(getattr(config, "hidden_size", 0) or 0)
    return params, embedding, layers, width, tied


WHOLE_STYLES = ("replicate", "replicated_with_grad_allreduce")  # TP styles that leave a parameter whole


def parts(m: DictConfig) -> dict[str, Any]:
    """Where a transformers decoder's parameters sit, from its meta-device build: layer 0's
    parameters and those its `base_model_tp_plan` leaves whole on every TP rank (norms, q/k norms,
    a row-parallel bias), the first stage's (embeddings: what sits outside the layers and the last
    stage's modules), the last stage's (final norm, an untied head) and the largest parameter; and
    the widths Llama's measured activation coefficients take (hidden, key/value width, intermediate).
    A dict (models.spec.Parts' fields), so this module stays free of Loom's plan types."""
    from loom.models.hf import parallel

    config = auto_config(m)
    model = meta_model(m)
    layers_path, _, last = parallel.pipeline_split(model)
    named = dict(model.named_parameters())  # a tied head once, under the embedding's name
    plan = parallel.expanded_tp_plan(model) if getattr(config, "base_model_tp_plan", None) else {}
    layer0 = f"{layers_path}.0."
    in_layers = {n for n in named if n.startswith(layers_path + ".")}
    per_layer = sum(p.numel() for n, p in named.items() if n.startswith(layer0))
    whole = sum(p.numel() for n, p in named.items() if n.startswith(layer0) and _whole_under_tp(n, plan))
    at_end = sum(p.numel() for n, p in named.items() if any(n == e or n.startswith(e + ".") for e in last))
    first = sum(p.numel() for n, p in named.items() if n not in in_layers) - at_end
    width = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (width // heads if heads else 0))
    kv = int(getattr(config, "num_key_value_heads", 0) or heads) * head_dim
    inner = int(getattr(config, "intermediate_size", 0) or 4 * width)
    return {"per_layer": per_layer, "per_layer_tp_whole": whole, "first": first, "last": at_end,
            "largest": max(p.numel() for p in named.values()), "width": width, "kv": kv, "inner": inner}


def _whole_under_tp(name: str, plan: dict[str, str]) -> bool:
    """A parameter the TP plan leaves whole: no rule for it or its module, a whole style, or a
    row-parallel bias (added after the reduction)."""
    module, _, param = name.rpartition(".")
    style = plan.get(name, plan.get(module))
    return style is None or style in WHOLE_STYLES or (style.startswith("rowwise") and param == "bias")
