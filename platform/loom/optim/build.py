"""Optimizer and LR schedule shared by every model (and every strategy: DeepSpeed gets this
torch optimizer object too, `zero_allow_untested_optimizer`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from loom.optim import OPTIMIZERS
from loom.schema import load


def _ndim(p: torch.Tensor) -> int:
    """Dimensions of the full parameter: a ZeRO-3 partition is flat, its shape is `ds_shape`."""
    return len(getattr(p, "ds_shape", p.shape))


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch has a fused kernel for every parameter: floating point, on a device torch
    lists for fused optimizers (cuda, cpu, xpu, mps, ...; torch's own `fused=True` check)."""
    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def use_fused(setting: Any, params: list[torch.Tensor], scaled_clipping: bool = False,
              on_dtensor: bool = True) -> bool:
    """`optim.fused`: true/false as given; auto: fused wherever torch supports it. (torch's own
    default stays on foreach, and never picks fused for DTensors, which fused AdamW handles.)

    `scaled_clipping`: fp16 with a loss scaler and gradient clipping. A fused optimizer unscales
    the gradients inside its step, after clipping would have seen them still scaled, so auto
    stays on foreach there (validation refuses `optim.fused=true` with it).
    `on_dtensor`: whether DTensor has a sharding rule for the optimizer's fused kernel (FSDP2's and
    tensor parallelism's parameters; AdamW's has one, SGD's not: auto stays on foreach there)."""
    sharded = any(isinstance(p, DTensor) for p in params)
    if setting == "auto":
        return fused_supported(params) and not scaled_clipping and (on_dtensor or not sharded)
    if setting and sharded and not on_dtensor:
        raise ValueError("optim.fused=true: torch has no fused kernel of this optimizer for sharded (DTensor) "
                         "parameters (strategy=fsdp, fsdp_tp, nd); use optim.fused=auto (foreach there)")
    return bool(setting)


def _groups(named_params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay on matrices only (not biases, norms' gains). Trainable parameters only (LoRA: the
    adapters; the frozen base gets no state), and no empty group: DeepSpeed drops one (a LoRA run
    has matrices alone), and the schedule's per-group lists would no longer match its groups."""
    decay = [p for _, p in named_params if p.requires_grad and _ndim(p) >= 2]
    no_decay = [p for _, p in named_params if p.requires_grad and _ndim(p) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] or groups[:1]


def make_optimizer(named_params: list[tuple[str, torch.nn.Parameter]], optim: DictConfig,
                   scaled_clipping: bool = False) -> torch.optim.Optimizer:
    """The torch optimizer `optim.name` names (adamw | sgd), fused per `optim.fused`."""
    groups = _groups(named_params, optim.weight_decay)
    fused = use_fused(optim.fused, [p for g in groups for p in g["params"]], scaled_clipping,
                      OPTIMIZERS[optim.name].fused_on_dtensor)
    return load(OPTIMIZERS[optim.name].build)(groups, optim, fused)


def adamw(groups: list[dict], optim: DictConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused)


def sgd(groups: list[dict], optim: DictConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, nesterov=optim.nesterov, fused=fused)


def build_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], optim: DictConfig, max_steps: int,
    scaled_clipping: bool = False,
) -> dict:
    """The optimizer + linear warmup and cosine decay, stepped per step."""
    opt = make_optimizer(named_params, optim, scaled_clipping)
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def sync_schedule(sched: Any) -> None:
    """Set each group's learning rate to the schedule's value at its current step.

    LambdaLR checkpoints its step but not its function (a closure over max_steps), so a run
    resumed with a raised `trainer.max_steps` follows the schedule recomputed for the new
    total from the resume step on; only the restored learning rate, set by the old schedule
    at the last step, is the old one, and this replaces it. Steps before the resume point
    followed the old schedule (plan.json `extended_from_steps` says so)."""
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        return
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        lr = base * fn(sched.last_epoch)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
