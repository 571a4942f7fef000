"""The schemas shared by families (LoRA) and of the options without a family folder (mlp, custom);
a family's own schema lives in its folder (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoraConfig:
    """`model.lora`: LoRA adapters through peft (loom.models.lora); r=0: off, the full model trains."""

    r: int = 0                        # the adapters' rank; > 0 freezes the base and trains adapters only
    alpha: float = 16.0               # peft's lora_alpha: the update is scaled by alpha / r
    dropout: float = 0.0              # peft's lora_dropout, on the adapter's input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # Linear module names


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
class CustomModelConfig:
    name: str = "custom"
    # `_target_` (+ its keyword arguments): a LightningModule, or an nn.Module trained with `loss`
    module: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime
