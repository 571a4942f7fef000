"""The data position (epoch, batches consumed in it) as checkpointed Callback state.

Counted by a callback rather than read from the sampler, because the DataLoader prefetches:
the sampler has always handed out more indices than the model has trained on.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl


class DataPosition(pl.Callback):
    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0  # micro-batches trained in `epoch` (this rank; equal on every rank)
        self._restored: tuple[int, int] | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch = trainer.current_epoch
        if self._restored and self._restored[0] == self.epoch:
            self.batches = self._restored[1]
        else:
            self.batches = 0
        self._restored = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        dm = trainer.datamodule
        if getattr(dm, "record_dir", None) is not None:  # LOOM_RECORD_SAMPLE_IDS (tests)
            dm.record_trained_batch(trainer.global_rank, trainer.global_step, self.epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Tell the sampler to skip what this epoch already consumed."""
        self._restored = (int(state["epoch"]), int(state["batches"]))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restored is None:
            return
        sampler = getattr(trainer.datamodule, "train_sampler", None)
        if sampler is None:
            return
        epoch, batches = self._restored
        sampler.resume_at(epoch, batches * trainer.datamodule.cfg.dataset.batch_size)
