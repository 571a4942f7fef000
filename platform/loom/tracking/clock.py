"""Where an attempt's time went, and which part of it is steady state.

The training loop's time (`on_train_start` to `on_train_end`) splits into validation, the
synchronous part of checkpoint saves, benchmark evaluation (`eval_s`: loom.worker.evaluation),
and training (`train_s`, the rest). `first_step_s` (the
first optimizer step, with any compile in it) and `compile_s` (the seconds torch spent compiling
during training steps, as its compile hooks timed them: loom.tracking.compiles) are parts of
training reported apart. The steady rates add up the log windows (from one log step to the next)
that start once `tracking.warmup_steps` steps are done (null: after the first logged window) and
in which no rank compiled: a compile or recompile at any step leaves its window out, the windows
before and after it still count. An average over the whole loop does not leave them out (a
compiled run's whole-loop tokens/s is a fraction of its step lines').

Each step's own training seconds after the attempt's first are kept too (the last STEP_TIMES, a
float per step, no I/O) and summarized in the span as their mean and their step-to-step noise
(von Neumann: std of successive differences / sqrt 2), which tells a sweep's trials apart on
throughput with a handful of steps (loom.report.tie) where logged windows are too few.

No torch here: `Clock` only reads perf_counter and the numbers it is given.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

STEP_TIMES = 4096  # per-step seconds kept per attempt (the noise estimate's window)


@dataclass
class Clock:
    """One attempt's loop time, by part. `checkpoint_seconds` is the saver's running total."""

    start_step: int = 0
    warmup_steps: int | None = None
    loop_start: float = 0.0
    validation_s: float = 0.0
    checkpoint_s: float = 0.0
    eval_s: float = 0.0                 # benchmark evaluation (eval.tasks) inside the loop
    compile_s: float = 0.0              # this rank's compile seconds during training steps
    first_step_s: float | None = None
    steady_step: int | None = None      # the log step the first steady window starts at
    steady_steps: int = 0               # steps in steady windows
    steady_train_s: float = 0.0         # their training seconds
    recompiles: list[dict[str, Any]] = field(default_factory=list)  # {step, seconds, reason}
    loop_end: float | None = None       # set when the loop ends (`stop`): the span is final
    _checkpoint_base: float = 0.0
    _window_step: int = 0               # where the current log window began: its step ...
    _window_train_s: float = 0.0        # ... and train_s then
    step_times: deque = field(default_factory=lambda: deque(maxlen=STEP_TIMES))  # seconds of steps 2, 3, ...
    _step_end: tuple[int, float] | None = None  # (step, train_s) at the last step's end

    def start(self, step: int, checkpoint_seconds: float = 0.0) -> None:
        self.start_step, self.loop_end, self._step_end = step, None, None
        self.step_times.clear()
        self.loop_start = time.perf_counter()
        self._checkpoint_base = checkpoint_seconds
        self._window_step, self._window_train_s = step, 0.0

    def train_s(self, now: float | None = None) -> float:
        """Loop time so far less validation, checkpoint saves and evaluation."""
        if not self.loop_start:  # the loop never started (a failure in setup)
            return 0.0
        now = (self.loop_end or time.perf_counter()) if now is None else now
        return max(0.0, now - self.loop_start - self.validation_s - self.checkpoint_s - self.eval_s)

    def stop(self) -> None:
        """The loop ended: later reads (the summary, written after the final weights) keep its time."""
        self.loop_end = time.perf_counter()

    def step_done(self, step: int, checkpoint_seconds: float) -> None:
        """After every micro batch (cheap: a clock read and an append per optimizer step)."""
        self.checkpoint_s = checkpoint_seconds - self._checkpoint_base
        if step <= self.start_step or (self._step_end is not None and step <= self._step_end[0]):
            return
        now = self.train_s()
        if self.first_step_s is None:
            self.first_step_s = now
        elif self._step_end is not None:
            self.step_times.append((now - self._step_end[1]) / (step - self._step_end[0]))
        self._step_end = (step, now)

    def step_stats(self) -> dict[str, Any]:
        """The steps after the first: how many, their mean seconds and step-to-step noise (None: too few)."""
        t = list(self.step_times)
        mean = sum(t) / len(t) if t else None
        noise = None
        if len(t) >= 3:
            diffs = [b - a for a, b in zip(t, t[1:], strict=False)]
            dm = sum(diffs) / len(diffs)
            noise = math.sqrt(sum((d - dm) ** 2 for d in diffs) / (len(diffs) - 1) / 2)
        return {"timed_steps": len(t), "step_s_mean": None if mean is None else round(mean, 6),
                "step_s_noise": None if noise is None else round(noise, 6)}

    def log_step(self, step: int, now: float, compile_s: float = 0.0, compiled: bool = False,
                 recompiles: list[dict[str, Any]] | None = None) -> bool:
        """At a log step, for the window since the last one: `compile_s` is this rank's compile
        time in it, `compiled` whether any rank compiled in it, `recompiles` this rank's. The
        window counts as steady if it began after warm-up and nobody compiled; returns whether."""
        train_now = self.train_s(now)
        begins, window_s = self._window_step, train_now - self._window_train_s
        self._window_step, self._window_train_s = step, train_now
        self.compile_s += compile_s
        self.recompiles.extend(recompiles or [])
        warm = begins - self.start_step >= (self.warmup_steps if self.warmup_steps else 1)
        if not warm or compiled or step <= begins:
            return False
        if self.steady_step is None:
            self.steady_step = begins
        self.steady_steps += step - begins
        self.steady_train_s += window_s
        return True

    def span(self, end_step: int, samples_per_step: int, items_per_sample: int) -> dict[str, Any]:
        """This attempt's entry fields (loom.rundir.world_history.update_attempt)."""
        train_s, steady_steps = self.train_s(), self.steady_steps
        return {
            "end_step": int(end_step),
            "samples": int((end_step - self.start_step) * samples_per_step),
            "items_per_sample": int(items_per_sample),
            "train_s": round(train_s, 4),
            "steady_steps": int(steady_steps),
            "steady_samples": int(steady_steps * samples_per_step),
            "steady_train_s": round(self.steady_train_s, 4),
            "compile_s": round(self.compile_s, 4),
            "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 4),
            "validation_s": round(self.validation_s, 4),
            "checkpoint_s": round(self.checkpoint_s, 4),
            "eval_s": round(self.eval_s, 4),
            "recompiles": list(self.recompiles),
            **self.step_stats(),
        }
