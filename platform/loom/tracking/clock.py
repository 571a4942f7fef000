"""Where an attempt's time went, and which part of it is steady state.

The training loop's time (`on_train_start` to `on_train_end`) splits into validation, the
synchronous part of checkpoint saves, and training (`train_s`, the rest). `first_step_s` (the
first optimizer step, with any compile in it) and `compile_s` (torch._dynamo's own count of
its compile time) are parts of training reported apart. The steady window starts at a log
step once `tracking.warmup_steps` steps are done (null: the first logged window), and starts
again after any log window in which torch compiled: steady rates leave compile and warm-up
out, which an average over the whole loop does not (a compiled run's whole-loop tokens/s is
a fraction of its step lines').

No torch here: `Clock` only reads perf_counter and the numbers it is given.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any


def dynamo_compile_seconds() -> float:
    """torch._dynamo's total compile time in this process so far (0 if it never compiled)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0.0
    try:
        return float(dynamo_utils.calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # a private helper: its absence must not fail a run
        return 0.0


@dataclass
class Clock:
    """One attempt's loop time, by part. `checkpoint_seconds` is the saver's running total."""

    start_step: int = 0
    warmup_steps: int | None = None
    loop_start: float = 0.0
    validation_s: float = 0.0
    checkpoint_s: float = 0.0
    compile_s: float = 0.0
    first_step_s: float | None = None
    steady_step: int | None = None      # the log step the steady window starts at
    steady_train_s: float = 0.0         # train_s at that step
    loop_end: float | None = None       # set when the loop ends (`stop`): the span is final
    _compile_base: float = 0.0
    _checkpoint_base: float = 0.0

    def start(self, step: int, checkpoint_seconds: float = 0.0) -> None:
        self.start_step, self.loop_end = step, None
        self.loop_start = time.perf_counter()
        self._compile_base = dynamo_compile_seconds()  # an in-process sweep's earlier trials compiled too
        self._checkpoint_base = checkpoint_seconds

    def train_s(self, now: float | None = None) -> float:
        """Loop time so far less validation and checkpoint saves."""
        if not self.loop_start:  # the loop never started (a failure in setup)
            return 0.0
        now = (self.loop_end or time.perf_counter()) if now is None else now
        return max(0.0, now - self.loop_start - self.validation_s - self.checkpoint_s)

    def stop(self) -> None:
        """The loop ended: later reads (the summary, written after the final weights) keep its time."""
        self.loop_end = time.perf_counter()

    def step_done(self, step: int, checkpoint_seconds: float) -> None:
        """After every optimizer step (cheap: a subtraction)."""
        self.checkpoint_s = checkpoint_seconds - self._checkpoint_base
        if self.first_step_s is None and step > self.start_step:
            self.first_step_s = self.train_s()

    def log_step(self, step: int, now: float) -> None:
        """At a log step: a window with a compile in it restarts the steady window."""
        compiled = dynamo_compile_seconds() - self._compile_base
        if compiled > self.compile_s + 1e-3:
            self.steady_step = None
        self.compile_s = compiled
        warm = step - self.start_step >= (self.warmup_steps if self.warmup_steps else 1)
        if self.steady_step is None and warm:
            self.steady_step, self.steady_train_s = step, self.train_s(now)

    def span(self, end_step: int, samples_per_step: int, items_per_sample: int) -> dict[str, Any]:
        """This attempt's entry fields (loom.rundir.world_history.update_attempt)."""
        train_s = self.train_s()
        steady_steps = end_step - self.steady_step if self.steady_step is not None else 0
        return {
            "end_step": int(end_step),
            "samples": int((end_step - self.start_step) * samples_per_step),
            "items_per_sample": int(items_per_sample),
            "train_s": round(train_s, 4),
            "steady_steps": int(steady_steps),
            "steady_samples": int(steady_steps * samples_per_step),
            "steady_train_s": round(train_s - self.steady_train_s, 4) if steady_steps > 0 else 0.0,
            "compile_s": round(self.compile_s, 4),
            "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 4),
            "validation_s": round(self.validation_s, 4),
            "checkpoint_s": round(self.checkpoint_s, 4),
        }
