"""The schemas of the model options (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GPTModelConfig:
    name: str = "gpt_tiny"
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256
    block_size: int = 256
    dropout: float = 0.0
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


@dataclass
class MLPModelConfig:
    name: str = "mlp"
    in_features: int | None = None    # null: from the dataset (digits: 64)
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    num_classes: int | None = None    # null: from the dataset (digits: 10)
    dropout: float = 0.0
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


@dataclass
class HFCausalLMModelConfig:
    name: str = "hf_causal_lm"
    config: str | None = None         # a local dir with config.json, or a name in the HF cache
    overrides: dict[str, Any] = field(default_factory=dict)  # set on the AutoConfig, e.g. {n_layer: 2}
    vocab_size: int | None = None     # null: the config's
    random_init: bool = False         # false: load the weights when they are local, else random
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


@dataclass
class CustomModelConfig:
    name: str = "custom"
    # `_target_` (+ its keyword arguments): a LightningModule, or an nn.Module trained with `loss`
    module: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


# Loom's GPT family: one schema, several sizes (conf/model/gpt_*.yaml).
GPT_SIZES = ("gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b")
