"""Where an attempt's time went, and which part of it is steady state.

The training loop's time (`on_train_start` to `on_train_end`) splits into validation, the
synchronous part of checkpoint saves, and training (`train_s`, the rest). `first_step_s` (the
first optimizer step, with any compile in it) and `compile_s` (the seconds torch spent compiling
during training steps, as its compile hooks timed them: loom.tracking.compiles) are parts of
training reported apart. The steady rates add up the log windows (from one log step to the next)
that start once `tracking.warmup_steps` steps are done (null: after the first logged window) and
in which no rank compiled: a compile or recompile at any step leaves its window out, the windows
before and after it still count. An average over the whole loop does not leave them out (a
compiled run's whole-loop tokens/s is a fraction of its step lines').

No torch here: `Clock` only reads perf_counter and the numbers it is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Clock:
    """One attempt's loop time, by part. `checkpoint_seconds` is the saver's running total."""

    start_step: int = 0
    warmup_steps: int | None = None
    loop_start: float = 0.0
    validation_s: float = 0.0
    checkpoint_s: float = 0.0
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

    def start(self, step: int, checkpoint_seconds: float = 0.0) -> None:
        self.start_step, self.loop_end = step, None
        self.loop_start = time.perf_counter()
        self._checkpoint_base = checkpoint_seconds
        self._window_step, self._window_train_s = step, 0.0

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
            "recompiles": list(self.recompiles),
        }
