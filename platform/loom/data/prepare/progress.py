"""Progress of a prepare: a rich bar on a terminal; elsewhere (a log, a CI job) a plain line at
most every 10 s and one at the end. Both are fed as each unit finishes."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Counts units, documents, input bytes and tokens; ETA from this run's input rate."""

    def __init__(self, n_units: int, total_bytes: int, mode: str = "auto",
                 log: Callable[[str], None] | None = None, every_s: float = 10.0) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.every_s = mode, every_s
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.n_units, self.total = n_units, total_bytes
        self.units = self.docs = self.tokens = self.bytes = self.run_bytes = self.run_docs = 0
        self.t0 = self.last = time.monotonic()
        self.bar: Any = None
        if self.mode == "bar":
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(TextColumn("prepare"), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), console=Console(stderr=True))
        self.task = self.bar.add_task("prepare", total=self.total or self.n_units, info="")
        self.bar.start()

    def add(self, stats: dict[str, Any], kept: bool = False) -> None:
        """One unit's counts (`kept`: finished by an earlier run, not counted in the rates)."""
        self.units += 1
        self.docs += stats["documents"]
        self.tokens += stats["tokens"]
        self.bytes += stats["bytes"]
        if not kept:
            self.run_bytes += stats["bytes"]
            self.run_docs += stats["documents"]
        now = time.monotonic()
        if self.bar is not None:
            self.bar.update(self.task, completed=self.bytes if self.total else self.units, info=self._info(now))
        elif self.mode == "lines" and now - self.last >= self.every_s:
            self.last = now
            self.log(self.line(now))

    def _rates(self, now: float) -> tuple[float, float]:
        dt = max(now - self.t0, 1e-9)
        return self.run_docs / dt, self.run_bytes / dt

    def _info(self, now: float) -> str:
        docs_s, bytes_s = self._rates(now)
        return (f"{self.units}/{self.n_units} units, {self.docs:,} docs ({docs_s:,.0f}/s), "
                f"{bytes_s / 1e6:.1f} MB/s, {self.tokens:,} tokens")

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        _, bytes_s = self._rates(now)
        if self.total:
            left = (self.total - self.bytes) / bytes_s if bytes_s > 0 else 0.0
            done = f"{self.bytes / 1e9:.2f} GB of {self.total / 1e9:.2f} GB, "
        else:
            per_unit = (now - self.t0) / max(1, self.units)
            left, done = per_unit * (self.n_units - self.units), ""
        return (f"prepare: {self.units}/{self.n_units} units, {self.docs:,} docs, {done}"
                f"{bytes_s / 1e6:.1f} MB/s, {self.tokens:,} tokens, ETA {_eta(left)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.mode == "lines":
            self.log(self.line())
