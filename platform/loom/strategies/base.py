"""What Loom asks every strategy besides Lightning's API: the model state one whole tensor at
a time (the final weights, streamed by `loom.worker.results`), the bytes this rank holds
(summary.json's memory figures, counted from tensors so `loom plan`'s estimate can be checked
against them), and how its checkpoints are written (in place, or in the background).

A method of each strategy class, as Lightning's fabric strategies own their state-dict
handling: the defaults below hold for strategies that keep whole tensors (single, DDP) and for
DTensors (FSDP2/TP); DeepSpeed overrides them.
"""

from __future__ import annotations

import os

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

    # ------------------------------------------------------------------ final weights
    def model_state_entries(self, trainer, module) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor as this rank holds it) for each entry of the plain `module.model.state_dict()`
        (a user's own LightningModule without `.model`: its own state): FSDP2/TP hold DTensor
        shards, ZeRO-3 empty partitioned parameters. Nothing is gathered or copied."""
        return list(getattr(module, "model", module).state_dict(keep_vars=True).items())

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The unsharded shape of an entry (a DTensor's `shape` is already the global one)."""
        return tuple(t.shape)

    def gather_full_tensor(self, trainer, t: torch.Tensor) -> torch.Tensor | None:
        """One entry, whole, on the CPU of global rank 0 (None elsewhere); a collective under
        sharding (a DTensor's `full_tensor()`), so every rank calls it for every entry in turn."""
        from torch.distributed.tensor import DTensor

        full = t.full_tensor() if isinstance(t, DTensor) else t
        return full.detach().cpu() if trainer.is_global_zero else None

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict:
        """The strategy's module state; a LoRA run's adapter alone (loom.models.lora)."""
        from loom.models.lora import adapter_state

        return adapter_state(self.lightning_module, super().lightning_module_state_dict())

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """A LoRA checkpoint's adapter, strictly (every adapter key, nothing else), into the rebuilt
        model; strategies that load elsewhere (DCP, DeepSpeed) hand no `state_dict` here."""
        from loom.models.lora import adapter_only, check_keys, trainable_keys

        module = self.lightning_module
        if adapter_only(module) and "state_dict" in checkpoint:
            check_keys(checkpoint["state_dict"], trainable_keys(module), "the checkpoint")
            module.load_state_dict(checkpoint["state_dict"], strict=False)
            return
        super().load_model_state_dict(checkpoint, strict)

    @property
    def checkpoint_io(self):
        """Lightning's TorchCheckpointIO, minus its BytesIO staging (see `DirectCheckpointIO`)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = direct_checkpoint_io()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        self._checkpoint_io = io

    @property
    def async_checkpoints(self) -> bool:
        """Whether `save_checkpoint` returns before the files are written (then
        `wait_for_checkpoint` must run before the checkpoint is renamed into place)."""
        return False

    def wait_for_checkpoint(self) -> None:
        """Block until the last `save_checkpoint` is complete on disk (sync strategies: it is)."""

    def local_state_bytes(self, trainer, module) -> tuple[int, int]:
        """(parameter bytes, optimizer-state bytes) this rank holds: the whole model, and the
        optimizer's state tensors (Adam m, v); DTensors count their local shards."""
        return param_bytes(module), sum(optim_state_bytes(o) for o in trainer.optimizers)


def direct_checkpoint_io():
    """A TorchCheckpointIO that `torch.save`s straight into the file.

    Lightning's `_atomic_save` first serializes the whole checkpoint into an `io.BytesIO` and
    then writes `getvalue()`, a copy of that buffer: the serialized state twice in host RAM on
    top of the live one (single, DDP; and ModelParallelStrategy's non-distributed save). Loom's
    checkpoint saver already makes the save atomic (`step-N.ckpt.partial`, renamed when every
    rank has written), so the file is written in place, one storage at a time, and fsynced.
    """
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    class DirectCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__} takes no storage_options")
            os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
            with open(path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())

    return DirectCheckpointIO()
