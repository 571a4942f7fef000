"""Step-boundary housekeeping callbacks: Python's garbage collector, and the collective timeout.

Garbage collection: CPython starts a generation-2 collection whenever enough container objects
were allocated, at whatever moment that is; in a multi-rank step one rank then pauses for tens
of milliseconds while the others wait for it in the next collective (a straggler that moves
from step to step). As torchtitan's `GarbageCollection` (torchtitan/tools/utils.py): once the
model is built, freeze what exists (it is never collected again), disable the automatic
collector, and collect the young generations every `trainer.gc_every_n_steps` steps, on every
rank at the same step. 0 leaves Python's own collector on.

Timeout: the process group is created with `hardware.timeout_init_s`; after the first step it
is shortened to `hardware.timeout_train_s` (`loom.worker.distributed.set_train_timeout`).
"""

from __future__ import annotations

import gc
import logging
import time

import pytorch_lightning as pl

from loom.worker.distributed import set_train_timeout  # here, not at the first step: no import in a step

log = logging.getLogger("loom")


class GarbageCollection(pl.Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every = every_n_steps
        self.collections = 0   # how many scheduled collections ran (tests, logs)
        self.seconds = 0.0     # their time, said once at the end (no log line in a training step)
        self._was_enabled = gc.isenabled()
        self._last = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After setup: the model, optimizer and data are built, so what exists now lives on."""
        if self.every <= 0:
            return
        self._was_enabled = gc.isenabled()
        self._last = trainer.global_step
        gc.collect()
        gc.freeze()
        gc.disable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Once per optimizer step: under gradient accumulation several micro-batches share a step.
        if self.every > 0 and step > self._last and step % self.every == 0:
            self._last = step
            start = time.perf_counter()
            gc.collect(1)
            self.collections += 1
            self.seconds += time.perf_counter() - start

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.collections:
            log.debug(f"gc.collect(1) every {self.every} steps: {self.collections} collections, "
                      f"{1000 * self.seconds:.1f} ms in all")
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """Give the process its collector back (an in-process sweep runs the next trial here)."""
        if self.every <= 0:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()


class TrainTimeout(pl.Callback):
    """Shorten the collective timeout to `hardware.timeout_train_s` once the first step is done."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.applied = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.applied:
            return
        self.applied = True
        if set_train_timeout(self.timeout_s) and trainer.global_rank == 0:
            log.info(f"collective timeout now {self.timeout_s:g} s (hardware.timeout_train_s)")
