"""Bytes each rank actually holds: local shards of parameters and optimizer states.

Counted from tensors, not estimated, so `loom plan`'s estimate can be checked against them.
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor stored on this rank (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def param_bytes(module: torch.nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters())


def grad_bytes(module: torch.nn.Module) -> int:
    return sum(tensor_bytes(p.grad) for p in module.parameters() if p.grad is not None)


def optim_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:  # skip scalar `step` counters
                total += tensor_bytes(v)
    return total
