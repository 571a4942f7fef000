"""Saving checkpoints during training: periodic, on preemption, atomic, with RNG state.

Hand-written instead of Lightning's ModelCheckpoint, which writes the newest file in place
(a kill mid-write leaves a truncated newest checkpoint), and instead of Lightning's SIGTERM
handling, which broadcasts from inside the signal handler (a deadlock when only one rank got
the signal) and stops without saving. Here a signal only sets a flag; at an optimizer step
boundary the ranks agree (an all-reduce of the flag), save, and stop. Over gloo (CPU) they
agree at every step; over NCCL only at logging steps, where the recorder synchronizes the
GPU anyway, so the hot path gains no device synchronization. (A separate gloo group for
this was tried: after a torchrun restart its rendezvous read a dead peer's address.)

Under `checkpoint.async` (fsdp, fsdp_tp) `trainer.save_checkpoint` returns once the state is
staged in host memory; the `.partial` is renamed only after `strategy.wait_for_checkpoint()`,
at the next save, at the end of training or on preemption (the final export waits too), so a
kill mid-write leaves a `.partial` that resume ignores.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.distributed as dist

from loom.atomic import atomic_symlink
from loom.rundir import checkpoints
from loom.rundir.paths import RunDir

log = logging.getLogger("loom")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM sends SIGUSR1 before the time limit


def rng_state() -> dict[str, Any]:
    """Every RNG of this process, as tensors and ints (loadable with weights_only=True)."""
    version, py_state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "python_version": version,
        "python_gauss": gauss,
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_cached": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():  # this rank's own device: a resume may see fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def own_cuda_state(saved: Any, device: int) -> torch.Tensor | None:
    """The saved CUDA RNG state of this rank's device: the tensor written since it is per
    device; in older checkpoints (every visible device's list) entry `device`, or None when a
    resume sees fewer GPUs than the writer did (indexing that list raised IndexError)."""
    if isinstance(saved, (list, tuple)):
        return saved[device] if device < len(saved) else None
    return saved


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_cached"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        own = own_cuda_state(state["cuda"], device)
        if own is not None:
            torch.cuda.set_rng_state(own, device)


def _no_sigterm_broadcast() -> None:
    """Stands in for Lightning's per-batch SIGTERM broadcast (see Checkpointing.on_train_start)."""


class Checkpointing(pl.Callback):
    def __init__(self, run_dir: Path, every_n_steps: int, keep_last: int, agree_every: int = 1) -> None:
        self.run_dir = run_dir
        self.agree_every = agree_every
        self.every = every_n_steps
        self.keep_last = keep_last
        self.requested_signal: int | None = None
        self.preempted = False
        self._distributed = False
        self._device = torch.device("cpu")
        self._pending_rng: dict[str, Any] | None = None
        self._last_saved = -1
        self._step_at_batch_start = -1
        self._pending: Path | None = None  # saved, not yet renamed into place (checkpoint.async)
        self._pending_since = 0.0
        self.seconds = 0.0  # training time spent in saves (waits for a background save included)
        self.writing = False  # inside `save`: the hang watchdog does not count a long write as a hang

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame) -> None:
        self.requested_signal = signum

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_saved = trainer.global_step
        self._distributed = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
        self._device = trainer.strategy.root_device
        # The ranks agree on a stop at log steps only: the agreement is a blocking collective (a
        # second sync point per step, ~2% of a 2-rank CPU DDP step measured: docs/benchmarks.md).
        self.agree_every = max(self.agree_every, trainer.log_every_n_steps)
        # Replaces Lightning's SIGTERM handler (it restores the originals at teardown).
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._on_signal)
        # Lightning (2.6) broadcasts a "SIGTERM received" flag from rank 0 before every batch and
        # reads it with .item(): a blocking collective and a device sync per micro-batch. Its flag
        # is set only by its own handler, replaced above; this callback's agreement does that job.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_sigterm_broadcast

    def _stop_requested(self, step: int, last: bool) -> bool:
        if not self._distributed:
            return self.requested_signal is not None
        if step % self.agree_every and not last:
            return False
        flag = torch.tensor([1 if self.requested_signal is not None else 0], dtype=torch.int32,
                            device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------ step boundary
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._pending_rng is not None:
            # Restored here, after the resumed epoch's DataLoader iterator drew its seed.
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Only at an optimizer-step boundary: a micro-batch that did not step (mid gradient
        # accumulation) would save step N with part of step N+1's samples consumed (the data
        # position then is no step boundary, and the resume fails or skips samples).
        if step == self._last_saved or step == self._step_at_batch_start:
            return
        if self._stop_requested(step, last=step >= trainer.max_steps):
            log.info(f"preemption signal received: saving a checkpoint at step {step} and stopping")
            self.save(trainer, step)
            self.finish_pending(trainer)
            self.preempted = True
            trainer.should_stop = True
            # Lightning validates when a run stops early (should_stop): not in the time a
            # preemption leaves (SLURM's warning); the resumed run validates on its schedule.
            epoch_loop = trainer.fit_loop.epoch_loop
            if hasattr(epoch_loop, "_skip_next_val"):
                epoch_loop._skip_next_val = True
        elif self.every and (step % self.every == 0 or step >= trainer.max_steps):
            # and at the last step: a completed run can be continued (a raised trainer.max_steps)
            self.save(trainer, step)

    def save(self, trainer: pl.Trainer, step: int) -> Path:
        """Write `step-N.ckpt.partial` on every rank; it becomes `step-N.ckpt` (and `last`) once
        complete: now, or under `checkpoint.async` when the next save starts, when training
        ends or on preemption (`finish_pending`)."""
        self.writing = True
        try:
            return self._save(trainer, step)
        finally:
            self.writing = False

    def _save(self, trainer: pl.Trainer, step: int) -> Path:
        started = time.perf_counter()
        self.finish_pending(trainer)
        final = checkpoints.step_path(self.run_dir, step)
        partial = final.with_name(final.name + ".partial")
        if trainer.is_global_zero:
            final.parent.mkdir(parents=True, exist_ok=True)
            checkpoints.remove(partial)
            for lg in trainer.loggers:  # metrics up to this step reach disk with the checkpoint
                lg.save()
        trainer.strategy.barrier("loom-checkpoint-start")
        log.debug(f"checkpoint step {step}: writing {partial}")
        trainer.save_checkpoint(str(partial))
        self._pending, self._pending_since = final, started
        self._last_saved = step
        if not trainer.strategy.async_checkpoints:
            self.finish_pending(trainer)
        elif trainer.is_global_zero:
            log.info(f"checkpoint step {step}: writing in the background "
                     f"(training resumed after {time.perf_counter() - started:.2f} s)")
        self.seconds += time.perf_counter() - started
        return final

    def finish_pending(self, trainer: pl.Trainer) -> None:
        """Wait until the pending checkpoint is written on every rank, then rename it into place
        and move `last`. Never runs for a save that failed or was cut short: its `.partial` stays
        and is ignored on resume."""
        final, self._pending = self._pending, None
        if final is None:
            return
        trainer.strategy.wait_for_checkpoint()
        trainer.strategy.barrier("loom-checkpoint-written")
        if trainer.is_global_zero:
            partial = final.with_name(final.name + ".partial")
            if final.exists():
                checkpoints.remove(final)
            os.replace(partial, final)
            last = RunDir(self.run_dir).last_checkpoint
            atomic_symlink(final.name, last)
            log.debug(f"checkpoint complete: {final} ({last.name} -> {final.name})")
            for old in checkpoints.complete_checkpoints(self.run_dir)[self.keep_last:]:
                checkpoints.remove(old)
            if trainer.strategy.async_checkpoints:
                log.info(f"checkpoint {final.name} complete: {time.perf_counter() - self._pending_since:.2f} s "
                         "from the start of its save")
        trainer.strategy.barrier("loom-checkpoint-done")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish_pending(trainer)

    # ------------------------------------------------------------------ checkpointed state
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """A user module's save_hyperparameters() may hold a credential: never on disk."""
        from loom.redaction import redact

        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = redact(checkpoint[key])

    def state_dict(self) -> dict[str, Any]:
        """Every rank's RNG state (gathered: only rank 0 writes the callback state)."""
        mine = rng_state()
        if self._distributed:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        return {"rng": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("rng") or []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank < len(states):
            self._pending_rng = states[rank]
