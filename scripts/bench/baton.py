"""Step-level interleaving of two training processes, and their per-step clocks.

Why: two sides run one after the other (or N then 2N steps, then a difference) each see the
machine's load of their own minutes; on a shared 2-core machine that swings a per-step figure
by +-15% between runs, more than the few percent being measured. Here both sides train at
the same time and take turns step by step, passing a baton through two named pipes: a step of
side A, then one of side B, then A... Each step of one side is a neighbour in time of a step
of the other, so a load that comes and goes hits both alike; the waiting side sleeps in a
blocking read (no CPU).

Each side times its own steps between receiving the baton and passing it on (a whole loop
iteration: data, forward, backward, optimizer, the platform's hooks), in wall time
(perf_counter) and in process CPU time (user + system of every thread of the process,
CLOCK_PROCESS_CPUTIME_ID), and at the end adds the CPU time its child processes used over the
steady window (a tracker's service process works while its parent waits). `slow` adds a
deliberate slowdown to every step, a fraction of the step's own time: sleep (wall time only)
or spin (wall and CPU), for showing what the estimator detects.

Torch-free: plain_gpt.py uses `Turns` and `StepLog` directly; `loom train` gets them through a
Lightning callback built by `loom_callback` (trainer.callbacks, security.allow_targets=[baton]).
Under torchrun each rank pairs with the other side's rank of the same number.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import time
from pathlib import Path
from typing import Any


def rank() -> int:
    return int(os.environ.get("RANK", 0))


class Turns:
    """This side's end of the baton: `a` moves first. Pipes `<dir>/<side>-<rank>` carry it
    from a side to the other; each is opened in an order that cannot deadlock."""

    def __init__(self, directory: str, side: str) -> None:
        other = "b" if side == "a" else "a"
        r = rank()
        mine, theirs = Path(directory) / f"to-{other}-{r}", Path(directory) / f"to-{side}-{r}"
        for p in (mine, theirs):
            try:
                os.mkfifo(p)
            except FileExistsError:
                pass
        # a opens its write end first, b its read end first: each open meets its partner's.
        if side == "a":
            self.wfd = os.open(mine, os.O_WRONLY)
            self.rfd = os.open(theirs, os.O_RDONLY)
        else:
            self.rfd = os.open(theirs, os.O_RDONLY)
            self.wfd = os.open(mine, os.O_WRONLY)
        self.side, self.alone = side, False

    def give(self) -> None:
        if self.alone:
            return
        try:
            os.write(self.wfd, b".")
        except OSError as e:  # the other side has ended: go on alone
            if e.errno != errno.EPIPE:
                raise
            self.alone = True

    def take(self) -> None:
        """Wait for the other side's step; returns at once when the other side has ended."""
        if not self.alone and os.read(self.rfd, 1) == b"":
            self.alone = True

    def begin(self) -> None:
        """Before the first step: b announces itself and waits; a waits for b."""
        if self.side == "b":
            self.give()
        self.take()

    def close(self) -> None:
        self.alone = True
        for fd in (self.wfd, self.rfd):
            try:
                os.close(fd)
            except OSError:
                pass


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's live descendants so far."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class StepLog:
    """One side's per-step clocks. `start()` when a step begins, `end()` when it ends; the
    arrays are preallocated Python lists appended to (O(1), no I/O until `write`)."""

    def __init__(self, side: str, slow: float = 0.0, slow_kind: str = "sleep") -> None:
        self.side, self.slow, self.slow_kind = side, float(slow), slow_kind
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.faults: list[int] = []           # minor page faults per step (fresh memory the allocator maps)
        self.started: list[float] = []        # perf_counter at each step's start (CLOCK_MONOTONIC: one clock
        #                                       for every process of the machine, so sides can be ordered)
        self.slowed: list[float] = []         # the deliberate slowdown added to each step (seconds asked for)
        self._t0 = self._c0 = 0.0
        self._f0 = 0
        self.children_cpu: list[float] = []   # descendants' CPU seconds, sampled at step ends 5 and last

    def start(self) -> None:
        self._f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def end(self) -> None:
        slowed = self.slow * (time.perf_counter() - self._t0) if self.slow > 0 else 0.0
        if slowed:
            self._slow_down(slowed)
        self.started.append(self._t0)
        self.slowed.append(slowed)
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._f0)
        if len(self.wall) == 5:
            self.children_cpu = [children_cpu_s()]

    def _slow_down(self, seconds: float) -> None:
        if self.slow_kind == "spin":
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(seconds)

    def write(self, directory: str, extra: dict[str, Any] | None = None) -> None:
        if len(self.children_cpu) == 1:
            self.children_cpu.append(children_cpu_s())
        out = Path(directory) / f"steps-{self.side}-{rank()}.json"
        out.write_text(json.dumps({"side": self.side, "rank": rank(), "wall_s": self.wall, "cpu_s": self.cpu,
                                   "started_s": self.started, "slowed_s": self.slowed, "minor_faults": self.faults,
                                   "children_cpu_s": self.children_cpu, "slow": self.slow,
                                   "slow_kind": self.slow_kind, **(extra or {})}))


GAP_S = 0.02  # the pause between a side's step and the other side's, on no one's clock


class Stepper:
    """Turns + StepLog at the step boundaries of a training loop: `boundary()` after every
    step (and once before the first); `finish()` after the last.

    Between its step and handing over, a side pauses `gap` seconds that no clock counts: an
    OpenMP worker thread spins for some milliseconds after the last parallel region it ran
    (libgomp's GOMP_SPINCOUNT), and without the pause that spin took a core from the other
    side's next step (seen here: a 3% sleep added at the end of one side's steps moved the
    ratio by 5.5%, the other side's steps got 5% faster once the sleep absorbed the spin)."""

    def __init__(self, directory: str, side: str, steps: int, slow: float = 0.0, slow_kind: str = "sleep",
                 gap: float = GAP_S) -> None:
        self.directory, self.steps, self.gap = directory, steps, gap
        self.turns = Turns(directory, side) if directory else None
        self.log = StepLog(side, slow, slow_kind)
        self.done = 0

    def first(self) -> None:
        if self.turns:
            self.turns.begin()
        self.log.start()

    def boundary(self) -> None:
        """A step ended: its clock stops, the other side takes its turn, the next step's starts."""
        self.log.end()
        self.done += 1
        if self.turns:
            if self.gap > 0:
                time.sleep(self.gap)
            self.turns.give()
            if self.done < self.steps:
                self.turns.take()
        self.log.start()

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        if self.turns:
            self.turns.close()
        self.log.write(self.directory or ".", extra)


def loom_callback(dir: str, side: str = "a", steps: int = 0, slow: float = 0.0,  # noqa: A002
                  slow_kind: str = "sleep", gap: float = GAP_S):
    """The Lightning callback for `loom train trainer.callbacks=[{_target_: baton.loom_callback,
    dir: D, side: a, steps: N}]`: last in Loom's list, so a step's clock covers every other
    callback's hooks of that step."""
    import pytorch_lightning as pl

    class Baton(pl.Callback):
        def __init__(self) -> None:
            self.stepper: Stepper | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.stepper = Stepper(dir, side, steps or trainer.max_steps, slow, slow_kind, gap)
            self.stepper.first()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.stepper.boundary()

        def on_train_end(self, trainer, pl_module) -> None:
            self.stepper.finish({"threads": _threads()})

    return Baton()


def _threads() -> int:
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return 0
