"""`model=hf_causal_lm`: a transformers causal LM from a config available locally.

`model.config` is a directory holding config.json (save_pretrained) or a name already in the
Hugging Face cache; nothing is downloaded (local_files_only=True). Random initialization
(AutoModelForCausalLM.from_config) unless the weights are local too and
`model.random_init=false`. Validation reads config.json as JSON (no torch, no transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _local_file(name: str, filename: str) -> Path | None:
    from loom.data.tokenizer import _cached_file

    return _cached_file(name, filename)


def config_dict(m: DictConfig) -> dict[str, Any]:
    """config.json of `model.config` with `model.overrides` and `model.vocab_size` applied."""
    f = _local_file(str(m.config), "config.json")
    if f is None:
        raise FileNotFoundError(m.config)
    data = json.loads(f.read_text())
    data.update(OmegaConf.to_container(m.overrides) if isinstance(m.overrides, DictConfig) else dict(m.overrides))
    if m.vocab_size is not None:
        data["vocab_size"] = int(m.vocab_size)
    return data


def context_length(data: dict[str, Any]) -> int | None:
    for key in CONTEXT_KEYS:
        if isinstance(data.get(key), int):
            return data[key]
    return None


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


def _source(m: DictConfig) -> str:
    p = Path(str(m.config)).expanduser()
    return str(p) if p.is_dir() else str(m.config)


def auto_config(m: DictConfig):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_source(m), local_files_only=True)
    overrides = OmegaConf.to_container(m.overrides) if isinstance(m.overrides, DictConfig) else dict(m.overrides)
    for k, v in overrides.items():
        setattr(config, k, v)
    if m.vocab_size is not None:
        config.vocab_size = int(m.vocab_size)
    return config


def build(m: DictConfig):
    """The architecture, randomly initialized; with pretrained `.bin` weights only (no
    safetensors for Loom to shard-load), transformers' from_pretrained, whole."""
    from transformers import AutoModelForCausalLM

    config = auto_config(m)
    if not m.random_init and has_local_weights(str(m.config)) and safetensors_dir(m) is None:
        return AutoModelForCausalLM.from_pretrained(_source(m), config=config, local_files_only=True)
    return AutoModelForCausalLM.from_config(config)


def count(m: DictConfig) -> tuple[int, int, int, int, bool]:
    """(params, embedding params, layers, width, tied head) of the model, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    config = auto_config(m)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    embedding = emb.numel() + sum(p.numel() for n, p in model.named_parameters()
                                  if ("wpe" in n or "position" in n) and p.dim() == 2)
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    width = int(getattr(config, "hidden_size", 0) or 0)
    return params, embedding, layers, width, tied
