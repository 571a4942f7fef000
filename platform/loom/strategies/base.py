"""What Loom asks every strategy besides Lightning's API: the consolidated model state (the
final weights) and the bytes this rank holds (summary.json's memory figures, counted from
tensors so `loom plan`'s estimate can be checked against them).

A method of each strategy class, as Lightning's fabric strategies own their state-dict
handling: the defaults below hold for strategies that keep whole tensors (single, DDP);
FSDP2/TP and DeepSpeed override them.
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


def optim_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:  # skip scalar `step` counters
                total += tensor_bytes(v)
    return total


class LoomStrategy:
    """Mixed into every Lightning strategy class Loom builds."""

    def full_model_state(self, trainer, module) -> dict:
        """The consolidated (unsharded) model state dict; a collective under sharding strategies,
        so call it on every rank. Keys are those of the plain `module.model.state_dict()` (a
        user's own LightningModule without `.model`: its own state)."""
        return getattr(module, "model", module).state_dict()

    def local_state_bytes(self, trainer, module) -> tuple[int, int]:
        """(parameter bytes, optimizer-state bytes) this rank holds: the whole model, and the
        optimizer's state tensors (Adam m, v); DTensors count their local shards."""
        return param_bytes(module), sum(optim_state_bytes(o) for o in trainer.optimizers)
