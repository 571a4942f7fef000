"""Optimizers (conf/optim/): the schema and checks here (torch-free); `build.py` builds the
optimizer and its schedule in the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from loom.errors import require
from loom.layout import ParallelLayout
from loom.schema import nothing_to_fill as normalize  # noqa: F401  (the group interface)


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1


SCHEMAS: dict[str, type] = {"adamw": AdamWConfig}


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    require(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
