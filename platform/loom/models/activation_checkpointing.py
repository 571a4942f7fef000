"""Activation checkpointing (`trainer.activation_checkpointing`), applied in the worker only.

Each checkpointed sharding unit (a GPT `Block`) keeps only its input from the forward pass
and recomputes its activations in backward. It is applied right after the model is built
(on the meta device), before tensor parallelism, FSDP2 or DeepSpeed, so every strategy gets
it the same way. The wrapper is torch's own `checkpoint_wrapper` with the non-reentrant
implementation, as torchtitan's `_apply_ac_to_transformer_block` (models/llama3/
parallelize.py) uses it: its state-dict hooks keep `state_dict()` keys free of the
`_checkpoint_wrapped_module.` prefix, so checkpoints and final weights do not change.
`loom plan`'s estimate of what this saves is `loom.plan.memory.activation_bytes`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)

MODES = ("none", "selective", "full")


def clean_name(name: str) -> str:
    """A parameter or module name without the wrapper's `_checkpoint_wrapped_module.`
    segment: `named_parameters()` of the parent model keeps it (only `state_dict()` drops
    it), and name-seeded initialization must see the same names with and without AC."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def apply_activation_checkpointing(model: nn.Module, units: tuple[type, ...], mode: str) -> int:
    """Wrap the `units` submodules of `model` in place; returns how many were wrapped.

    `full`: every unit; `selective`: every other unit in module order (units 0, 2, 4, ...:
    about half the activation memory of `none` for about half the recompute of `full`);
    `none`: nothing. Units nested inside another unit are not wrapped twice. Works on a
    model still on the meta device (the wrapper holds no tensors of its own); the unit stays
    inside the wrapper, so an `isinstance(sub, units)` walk over `model.modules()` still
    finds it (FSDP2 and the tensor-parallel plan shard it there).
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: valid choices are {', '.join(MODES)}")
    if mode == "none" or not units:
        return 0
    targets = _outermost_units(model, units)
    if mode == "selective":
        targets = targets[::2]
    for parent, attr, unit in targets:
        wrapped = checkpoint_wrapper(unit, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)) and attr.isdigit():
            parent[int(attr)] = wrapped
        else:
            setattr(parent, attr, wrapped)
    return len(targets)


def _outermost_units(model: nn.Module, units: tuple[type, ...]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, unit) of each unit not inside another unit, in module order
    (why a walk and not `named_modules()`: a unit's own children must not be visited)."""
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(parent: nn.Module) -> None:
        for attr, child in parent.named_children():
            if isinstance(child, units):
                found.append((parent, attr, child))
            else:
                visit(child)

    if isinstance(model, units):
        raise ValueError(f"{type(model).__name__} is itself a sharding unit: wrap its parent instead")
    visit(model)
    return found
