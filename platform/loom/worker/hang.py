"""`hardware.hang_timeout_s`: a watchdog thread in every rank that notices a training loop
making no progress, and says where each rank is before the collective timeout would kill the
run with nothing but a torchrun traceback.

Armed after the first step (compilation and start-up are not hangs); a finished training or
validation batch is progress, and so is a checkpoint still being written (a large model's save
can outlast the timeout; a save that never ends still meets the collective timeout). When nothing progressed for the timeout, the rank writes every
thread's Python stack (faulthandler) to `<run>/logs/hang-rank-N.txt` (on NCCL also the flight
recorder's record of its collectives, `hang-rank-N.nccl.pkl`) and a failure record of type
`hang` naming its main thread's frame (loom.rundir.hangs turns the ranks' records into one
paragraph). Every rank's timer started at about the same step, so all of them dump; after a
grace period for the others' dumps the rank exits 1, and torchrun fails the run or restarts
it under `hardware.max_restarts`, as for any failure. A one-process run trains inside the
launcher's own process: there the watchdog writes the stacks and the log line only.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytorch_lightning as pl

from loom.errors import EXIT_FAILED
from loom.rundir.failures import write_failure
from loom.rundir.hangs import frame_label
from loom.rundir.paths import RunDir
from loom.worker.failure import Progress

log = logging.getLogger("loom")
GRACE_S = 3.0  # after its dump, how long a rank waits for its peers' dumps before it exits


class HangWatchdog(pl.Callback):
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, progress: Progress,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self.run_dir, self.rank, self.timeout_s, self.progress = run_dir, rank, timeout_s, progress
        self.busy = busy  # a checkpoint being written: slow is not hung (the collective timeout still applies)
        self.last = time.monotonic()
        self.armed = False
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def beat(self) -> None:
        self.last = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.beat()
        if not self.armed:
            self.armed = True
            self.thread = threading.Thread(target=self._watch, name="loom-hang-watchdog", daemon=True)
            self.thread.start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.beat()

    def on_train_end(self, trainer, pl_module) -> None:
        self.stop.set()  # the results (final weights: long for a large model) are not the loop

    def _watch(self) -> None:
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        while not self.stop.wait(1.0):
            if self.busy():
                self.beat()
                continue
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._report(idle, record=under_torchrun)
                if not under_torchrun:  # in the launcher's own process: say it, never kill it
                    return
                self.stop.wait(GRACE_S)
                if self.stop.is_set():  # the loop ended after all
                    return
                logging.shutdown()
                os._exit(EXIT_FAILED)

    def _report(self, idle: float, record: bool = True) -> None:
        """hang-rank-N.txt (every thread's stack) and this rank's `hang` failure record."""
        path = RunDir(self.run_dir).hang(self.rank)
        step = self.progress.step() + 1  # the step in progress
        frame = sys._current_frames().get(threading.main_thread().ident)
        label, where = frame_label(frame)
        with open(path, "w") as f:
            f.write(f"rank {self.rank} (host {os.uname().nodename}, pid {os.getpid()}): no step progress for "
                    f"{idle:.0f} s at step {step} (hardware.hang_timeout_s={self.timeout_s:g}); main thread "
                    f"{label} at {where}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _dump_flight_recorder(RunDir(self.run_dir).hang_nccl(self.rank))
        log.error(f"no step progress for {idle:.0f} s at step {step}: {label} at {where}; stacks in {path}")
        if not record:
            return
        write_failure(self.run_dir, {
            "type": "hang", "message": f"no step progress for {idle:.0f} s; main thread {label}",
            "rank": self.rank, "step": step, "log": str(path), "where": where, "label": label,
            "phase": self.progress.phase, "timeout_s": self.timeout_s, "deterministic": False,
            "collateral": False, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "host": os.uname().nodename, "pid": os.getpid(), "time": time.time(),
        })


def _dump_flight_recorder(path: Path) -> None:
    """NCCL's flight recorder (the collectives this rank issued and their states), when it runs."""
    try:
        import torch

        if not (torch.cuda.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_backend() == "nccl"):
            return
        path.write_bytes(torch._C._distributed_c10d._dump_nccl_trace())
    except Exception as e:  # the stacks are the main record; this is a bonus
        log.debug(f"NCCL flight recorder not dumped ({type(e).__name__}: {e})")
