"""`trainer.profile`: torch.profiler over a window of steps on every rank, as a Lightning callback.

Steps are Loom's (1 = the first optimizer step); the window [start, stop) is driven by a schedule
on the absolute step, so the trace's `ProfilerStep#N` annotations are Loom's step numbers and a
resumed run profiles only what is left of the window. Each rank exports
`<run>/profile/rank-N.pt.trace.json.gz` (Chrome/Perfetto, TensorBoard's profiler plugin); rank 0
also writes `profile/summary.json` (loom.worker.profile_summary) for `loom report`. With
`memory=true` the profiler records allocations (the CPU allocator's peak per phase comes from
them) and, on a GPU, `torch.cuda.memory._record_memory_history` covers the window and
`profile/memory-rank-N.pickle` is the snapshot https://pytorch.org/memory_viz reads.
The profiler only observes: the losses of a profiled run are those of an unprofiled one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from loom.rundir.paths import RunDir

log = logging.getLogger("loom")
MEMORY_ONLY_STEPS = 3  # memory=true without steps: the first three steps (the optimizer state appears in step 1)


def profile_window(cfg: DictConfig) -> tuple[int, int] | None:
    """[start, stop) of Loom steps to profile, or None."""
    prof = cfg.trainer.get("profile")
    if not prof:
        return None
    if prof.steps is not None:
        return int(prof.steps[0]), int(prof.steps[1])
    if prof.memory:
        return 1, min(1 + MEMORY_ONLY_STEPS, int(cfg.trainer.max_steps) + 1)
    return None


class Profiling(pl.Callback):
    """Starts torch.profiler at train start, steps it at every optimizer step, exports at the
    window's end; marks forward / backward / optimizer as `loom:<phase>` ranges in the window."""

    def __init__(self, cfg: DictConfig, run_dir: Path, rank: int, window: tuple[int, int]) -> None:
        self.cfg, self.rank, self.window = cfg.trainer.profile, rank, window
        self.paths = RunDir(run_dir)
        self.dir = self.paths.profile
        self.prof: profile | None = None
        self.cuda_memory = False
        self._history = False  # CUDA memory history being recorded
        self._phase: record_function | None = None
        self._last_step = 0

    def _schedule(self, step: int) -> ProfilerAction:
        start, stop = self.window
        if step == start - 1:
            return ProfilerAction.WARMUP
        if start <= step < stop - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == stop - 1 else ProfilerAction.NONE

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = trainer.global_step + 1  # the step this attempt trains first
        if first >= self.window[1]:
            return  # a resume past the window
        self.dir.mkdir(parents=True, exist_ok=True)
        cuda = pl_module.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self.prof = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._export,
                            record_shapes=self.cfg.shapes, with_stack=self.cfg.stacks,
                            profile_memory=self.cfg.memory)
        self.prof.step_num, self.prof.current_action = first, self._schedule(first)  # Loom's step numbers
        self.prof.start()
        self.cuda_memory = cuda and self.cfg.memory
        self._last_step = trainer.global_step
        log.info(f"profiling steps {self.window[0]}-{self.window[1] - 1} into {self.dir}")

    def _recording(self) -> bool:
        return self.prof is not None and self.prof.current_action in (ProfilerAction.RECORD,
                                                                       ProfilerAction.RECORD_AND_SAVE)

    def _enter(self, phase: str | None) -> None:
        """Close the open phase range, open `phase` (None: none), inside the window only."""
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        if phase and self._recording():
            self._phase = record_function(f"loom:{phase}")
            self._phase.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self.prof is None:
            return
        if self.cuda_memory and not self._history and self._recording():
            self._history = True
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._enter("forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.prof is not None:
            self._enter("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.prof is not None:
            self._enter(None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.prof is not None:
            self._enter("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        if self.prof is None:
            return
        self._enter(None)
        if trainer.global_step > self._last_step:  # an optimizer step ended (not a micro batch)
            self._last_step = trainer.global_step
            self.prof.step()
            if trainer.global_step + 1 >= self.window[1]:
                self._stop()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.prof is not None:
            self._enter(None)
            prof, self.prof = self.prof, None
            prof.stop()

    def _export(self, prof: profile) -> None:
        """The window's end: this rank's trace (and CUDA memory snapshot); rank 0's summary."""
        trace = self.paths.profile_trace(self.rank)
        prof.export_chrome_trace(str(trace))
        snapshot = None
        if self._history:
            snapshot = self.paths.profile_memory(self.rank)
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        log.info(f"profile written: {trace}" + (f", {snapshot}" if snapshot else ""))
        if self.rank == 0:
            from loom.worker.profile_summary import write_summary

            write_summary(trace, self.paths.profile_summary, self.window, snapshot)
