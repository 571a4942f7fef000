"""Optimizer and LR schedule shared by every model."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig


def _ndim(p: torch.Tensor) -> int:
    """Dimensions of the full parameter: a ZeRO-3 partition is flat, its shape is `ds_shape`."""
    return len(getattr(p, "ds_shape", p.shape))


def build_optimizer(
    named_params: list[tuple[str, torch.nn.Parameter]], optim: DictConfig, max_steps: int
) -> dict:
    """AdamW (decay on matrices only) + linear warmup and cosine decay, stepped per step."""
    decay = [p for _, p in named_params if p.requires_grad and _ndim(p) >= 2]
    no_decay = [p for _, p in named_params if p.requires_grad and _ndim(p) < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
    )
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
