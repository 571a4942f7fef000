"""What torch compiled during the training loop, at which step, for how long, and why.

torch._dynamo runs its compile hooks (`torch._dynamo.callback.callback_handler`: start and end
callbacks, each with a trigger and a compile id) around every compile of a frame (DYNAMO) and
every backward graph compiled at its first use (LAZY_BACKWARD). Watching them, rather than
assuming a compile in a fixed first window, finds a recompile at any step: a new input shape, a
guard that fails, a code path first taken late. Its reason is the guard that failed, which
dynamo records in `torch._dynamo.utils.guard_failures` just before it recompiles.

Each event is stamped with the step in progress and the phase (training or validation) that the
recorder keeps current. The attempt's first step compiles by design; a frame compiled in training
at any later step is a recompile (summary.json `recompiles`). Validation's compiles (eval mode
and no_grad are new graphs) are part of validation's time and leave training's alone.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

REASON_CHARS = 300  # a guard failure can name a long expression: enough to see which guard


@dataclass
class CompileEvent:
    step: int           # the optimizer step in progress (global_step + 1)
    phase: str          # "train" | "validation"
    trigger: str        # DYNAMO (a frame) | LAZY_BACKWARD (its backward, at first use) | ...
    compile_id: str     # dynamo's "<frame>/<count>": count > 0 is a recompile of that frame
    seconds: float
    reason: str | None  # the guard(s) that failed, when torch recompiled a frame


def _args_of(args: tuple) -> tuple[str, str]:
    """(trigger, compile id) of a callback's arguments (torch before 2.8 passes none)."""
    a = args[0] if args else None
    trigger = getattr(getattr(a, "callback_trigger", None), "name", "DYNAMO")
    return str(trigger), str(getattr(a, "compile_id", "?"))


class CompileWatch:
    """This process's compiles between `start` and `stop`, through torch._dynamo's hooks.
    `step` and `phase` are set by the recorder on the hot path (two attribute writes)."""

    def __init__(self) -> None:
        self.step = 0
        self.phase = "train"
        self._events: list[CompileEvent] = []
        self._open: tuple | None = None      # (start time, step, phase, trigger, id, reason)
        self._seen: dict[Any, int] = {}      # guard failures already read, per code object
        self._handler = None
        self._lock = threading.Lock()        # a lazy backward may compile on autograd's thread

    def start(self) -> None:
        """Hook into torch._dynamo (once); earlier guard failures are not this loop's reasons."""
        self._new_failures()
        if self._handler is not None:
            return
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:  # a torch without the hooks: no compile is detected
            return
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        self._handler = callback_handler

    def stop(self) -> None:
        """Unhook (an in-process sweep's next trial has its own watch)."""
        handler, self._handler = self._handler, None
        if handler is None:
            return
        for callbacks, fn in ((handler.start_callbacks, self._on_start), (handler.end_callbacks, self._on_end)):
            if fn in callbacks:  # torch._dynamo.reset() clears them
                callbacks.remove(fn)

    def drain(self) -> list[CompileEvent]:
        """The compiles that ended since the last drain."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _on_start(self, *args: Any) -> None:
        trigger, compile_id = _args_of(args)
        self._open = (time.perf_counter(), self.step, self.phase, trigger, compile_id, self._new_failures())

    def _on_end(self, *args: Any) -> None:
        opened, self._open = self._open, None
        if opened is None:
            return
        began, step, phase, trigger, compile_id, reason = opened
        event = CompileEvent(step, phase, trigger, compile_id, time.perf_counter() - began, reason)
        with self._lock:
            self._events.append(event)

    def _new_failures(self) -> str | None:
        """The guard failures dynamo recorded since the last call, one line each, or None."""
        failures = getattr(sys.modules.get("torch._dynamo.utils"), "guard_failures", None)
        if not isinstance(failures, dict):
            return None
        lines: list[str] = []
        for code, reasons in list(failures.items()):
            seen = self._seen.get(code, 0)
            lines += [str(r).split("\n", 1)[0].strip()[:REASON_CHARS] for r in reasons[seen:]]
            self._seen[code] = len(reasons)
        return "; ".join(dict.fromkeys(x for x in lines if x)) or None


def training_compiles(events: list[CompileEvent]) -> list[CompileEvent]:
    return [e for e in events if e.phase == "train"]


def recompiles(events: list[CompileEvent], first_step: int) -> list[dict[str, Any]]:
    """The frames compiled in training after the attempt's first step, as summary.json records
    them (their backward graphs' compile time is counted with them, not apart)."""
    return [{"step": e.step, "seconds": round(e.seconds, 4), "reason": e.reason or f"a frame's first compile (dynamo {e.compile_id})"}
            for e in training_compiles(events) if e.trigger == "DYNAMO" and e.step > first_step]


def warning(begins: int, step: int, found: list[dict[str, Any]], ranks: list[int]) -> str:
    """The console's one line for a log window (begins, step] in which ranks compiled."""
    window = f"steps {begins + 1}-{step}" if step > begins + 1 else f"step {step}"
    if found:
        steps = ", ".join(str(s) for s in sorted({r["step"] for r in found}))
        reasons = "; ".join(dict.fromkeys(r["reason"] for r in found))
        what = f"torch recompiled at step {steps} ({reasons})"
    else:
        what = f"torch compiled on rank {', '.join(map(str, ranks))}"
    return f"{what}: {window} left out of the steady throughput"


def summary_field(history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json `recompiles` from every attempt's span: how many, at which steps, and why."""
    found = [r for a in history for r in a.get("recompiles") or []]
    return {"count": len(found), "steps": sorted({int(r["step"]) for r in found}),
            "reasons": list(dict.fromkeys(str(r["reason"]) for r in found))}
