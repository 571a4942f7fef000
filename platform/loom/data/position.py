"""The data position as checkpointed Callback state: the epoch, and the samples of its global
order the world has consumed (`loom.data.sampler`), so a run resumes at any data-parallel size.

Counted by a callback rather than read from the sampler, because the DataLoader prefetches:
the sampler has always handed out more indices than the model has trained on.

A resume at another dp size (a world change) also rescales Lightning's own per-rank batch
counters of the epoch (`batch_progress`, which decide accumulation boundaries and the epoch's
end) to the new world's micro batches: the same samples, counted in the new world's batches.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl


class DataPosition(pl.Callback):
    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0  # micro-batches trained in `epoch` (this rank; equal on every rank)
        self._restored: dict[str, int] | None = None

    @staticmethod
    def _shape(trainer: pl.Trainer) -> tuple[int, int]:
        """(micro batch, data-parallel size) of this world."""
        dm = trainer.datamodule
        return int(dm.cfg.dataset.batch_size), int(dm.dp_size)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch = trainer.current_epoch
        if self._restored and self._restored["epoch"] == self.epoch:
            micro, dp = self._shape(trainer)
            self.batches = self._restored["samples"] // (micro * dp)
        else:
            self.batches = 0
        self._restored = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        dm = trainer.datamodule
        if getattr(dm, "record_dir", None) is not None:  # LOOM_RECORD_SAMPLE_IDS (tests)
            # the optimizer step this micro batch belongs to (it has run on the step's last one)
            step = trainer.global_step + (0 if self.batches % trainer.accumulate_grad_batches == 0 else 1)
            dm.record_trained_batch(trainer.global_rank, step, self.epoch)

    def state_dict(self) -> dict[str, Any]:
        """`samples`: of the epoch's global order, consumed by the whole world; `batches` and `dp`:
        this world's count (older checkpoints hold only `epoch` and `batches`)."""
        micro, dp = self._shape(self._trainer) if getattr(self, "_trainer", None) else (0, 0)
        return {"epoch": self.epoch, "batches": self.batches, "samples": self.batches * micro * dp, "dp": dp}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Tell the sampler to skip what this epoch already consumed: through the datamodule, which
        hands it to the sampler it makes. Not at train start: Lightning iterates the train loader in
        `setup_data`, before on_train_start, and a loader with workers pulls its first indices from
        the sampler right then (a resume with hardware.dataloader_workers > 0 restarted the epoch)."""
        self._restored = r = {k: int(v) for k, v in state.items() if v is not None}
        trainer = getattr(self, "_trainer", None)
        dm = getattr(trainer, "datamodule", None)
        if dm is None:
            return
        micro, dp = self._shape(trainer)
        if "samples" not in r:  # a checkpoint from before the global position: saved at this world
            r["samples"], r["dp"] = r["batches"] * micro * dp, dp
        dm.resume_position = (r["epoch"], r["samples"])

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._restored is None:
            return
        sampler = getattr(trainer.datamodule, "train_sampler", None)
        micro, dp = self._shape(trainer)
        r = self._restored
        if "samples" not in r:  # a checkpoint from before the global position: saved at this world
            r["samples"], r["dp"] = r["batches"] * micro * dp, dp
        if r["dp"] != dp:
            rescale_batch_progress(trainer, r["dp"], dp)
        # Lightning skips on_train_epoch_start when it restarts mid-epoch: the count starts here
        self.epoch, self.batches = r["epoch"], r["samples"] // (micro * dp)
        if sampler is not None and getattr(trainer.datamodule, "resume_position", None) is None:
            sampler.resume_at(r["epoch"], r["samples"])  # a datamodule that was not told at restore


def rescale_batch_progress(trainer: pl.Trainer, dp_old: int, dp_new: int) -> None:
    """Lightning's per-rank batch counters of the epoch loop, restored from a world of `dp_old`
    data-parallel ranks, in this world's batches (the same samples: x dp_old / dp_new). Each
    counter keeps its offset from `ready` (a checkpoint saved mid-batch-end has completed =
    ready - 1), so Lightning's restart logic still sees the stage it was saved at."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    this_epoch = progress.current.ready
    earlier = progress.total.ready - this_epoch
    for tracker, base in ((progress.current, 0), (progress.total, earlier * dp_old // dp_new)):
        ready = base + this_epoch * dp_old // dp_new
        offsets = {f: tracker.ready - getattr(tracker, f) for f in ("ready", "started", "processed", "completed")}
        for field, offset in offsets.items():
            setattr(tracker, field, ready - offset)
