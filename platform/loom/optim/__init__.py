"""Optimizers (conf/optim/: one yaml per optimizer, `optim=adamw|sgd`): the schemas and checks
here (torch-free); `build.py` builds the optimizer and its schedule in the worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from loom.errors import require
from loom.layout import ParallelLayout


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    warmup_ratio: float | None = None  # a share of trainer.max_steps; when set, it gives warmup_steps
    min_lr_ratio: float = 0.1
    fused: Any = "auto"         # auto | true | false: torch's fused kernel (auto: where torch has one)


@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9       # 0: plain SGD, no state
    nesterov: bool = False
    weight_decay: float = 0.0
    warmup_steps: int = 10
    warmup_ratio: float | None = None  # a share of trainer.max_steps; when set, it gives warmup_steps
    min_lr_ratio: float = 0.1
    fused: Any = "auto"


def _check_adamw(o: DictConfig) -> None:
    require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas),
            "must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    require(o.eps > 0, "optim.eps", o.eps, "must be > 0")


def _check_sgd(o: DictConfig) -> None:
    require(o.momentum >= 0, "optim.momentum", o.momentum, "must be >= 0 (0: no momentum)")
    require(not o.nesterov or o.momentum > 0, "optim.nesterov", o.nesterov,
            "Nesterov momentum needs optim.momentum > 0")


@dataclass(frozen=True)
class OptimizerOption:
    schema: type
    check: Callable[[DictConfig], None]          # the option's own fields
    state_slots: Callable[[DictConfig | None], int]  # per-parameter state tensors (plan's optimizer bytes)
    build: str                                   # "loom.optim.build:function" (param groups, cfg, fused); torch
    fused_on_dtensor: bool = True                # DTensor has a sharding rule for its fused kernel (FSDP2, TP)


# AdamW keeps m and v; SGD its momentum buffer, none without momentum.
OPTIMIZERS: dict[str, OptimizerOption] = {
    "adamw": OptimizerOption(AdamWConfig, _check_adamw, lambda o: 2, "loom.optim.build:adamw"),
    "sgd": OptimizerOption(SGDConfig, _check_sgd, lambda o: 1 if o.momentum > 0 else 0, "loom.optim.build:sgd",
                           fused_on_dtensor=False),  # torch has no DTensor rule for aten._fused_sgd_
}
SCHEMAS: dict[str, type] = {name: option.schema for name, option in OPTIMIZERS.items()}


def state_slots(optim: DictConfig | None) -> int:
    """Per-parameter state tensors the optimizer keeps (the plan's optimizer bytes follow). None: AdamW."""
    return OPTIMIZERS["adamw" if optim is None else optim.name].state_slots(optim)


def run_warnings(cfg: DictConfig) -> list[str]:
    """What the run will do that is allowed but rarely meant (`loom plan` / `loom train` print
    each once): optim.lr=0 is a frozen evaluation or a save/load round trip, not a refusal."""
    if cfg.optim.lr == 0:
        return ["optim.lr=0: the optimizer never changes the weights (a frozen evaluation or a round "
                "trip); the loss is still computed and logged every step."]
    return []


def normalize(cfg: DictConfig) -> None:
    """`optim.warmup_ratio` (SFT's usual 3%) becomes the concrete warmup_steps the frozen config shows."""
    o = cfg.optim
    ratio = o.get("warmup_ratio")
    if ratio is not None:
        require(0 <= ratio < 1, "optim.warmup_ratio", ratio, "must be in [0, 1): the share of trainer.max_steps "
                "spent warming up (null: optim.warmup_steps)")
        o.warmup_steps = round(float(ratio) * int(cfg.trainer.max_steps))


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    o = cfg.optim
    require(o.lr >= 0, "optim.lr", o.lr, "must be >= 0 (0: a frozen evaluation; the weights never change)")
    require(isinstance(o.fused, bool) or o.fused == "auto", "optim.fused", o.fused,
            "valid choices: auto, true, false (auto: torch's fused kernel where it has one)")
    require(not (o.fused is True and cfg.hardware.precision == "16-mixed" and cfg.trainer.gradient_clip_val),
            "optim.fused", o.fused, "a fused optimizer unscales fp16 gradients inside its step, after "
            "gradient clipping would see them still scaled: use optim.fused=auto (foreach here), "
            "hardware.precision=bf16-mixed, or ~trainer.gradient_clip_val")
    require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be between 0 and 1")
    OPTIMIZERS[o.name].check(o)
