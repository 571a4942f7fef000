"""Progress of a prepare: a rich bar on a terminal; elsewhere (a log, a CI job) a plain line at
most every 10 s and one at the end. Fed as each unit finishes and, while units run, by their
reports about every second (so a line comes every 10 s even while one big unit is at work).
Shards kept from an interrupted run are counted apart: the rate and the ETA are this run's."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def _eta(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Counts units, documents, text bytes and tokens; ETA from this run's text rate."""

    def __init__(self, n_units: int, total_bytes: int, mode: str = "auto",
                 log: Callable[[str], None] | None = None, every_s: float = 10.0) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.every_s = mode, every_s
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.n_units, self.total = n_units, total_bytes
        self.units = self.tokens = self.run_bytes = self.run_docs = 0
        self.kept_units = self.kept_bytes = self.kept_docs = 0
        self.running: dict[int, tuple[int, int, int]] = {}  # unit -> (bytes, documents, tokens) so far
        self.finished: set[int] = set()  # a late report of a finished unit is dropped
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
        self.running.pop(stats["unit"], None)
        self.finished.add(stats["unit"])
        self.units += 1
        self.tokens += stats["tokens"]
        if kept:
            self.kept_units += 1
            self.kept_bytes += stats["bytes"]
            self.kept_docs += stats["documents"]
        else:
            self.run_bytes += stats["bytes"]
            self.run_docs += stats["documents"]
        self.tick()

    def partial(self, report: tuple[int, int, int, int]) -> None:
        """A running unit's (unit, bytes read, documents, tokens) so far."""
        unit, *counts = report
        if unit not in self.finished:
            self.running[unit] = (counts[0], counts[1], counts[2])
        self.tick()

    def tick(self) -> None:
        """Show the counts: the bar at once, a line when `every_s` has passed since the last."""
        now = time.monotonic()
        if self.bar is not None:
            done = self.kept_bytes + self._new()[0]
            self.bar.update(self.task, completed=done if self.total else self.units, info=self._info(now))
        elif self.mode == "lines" and now - self.last >= self.every_s:
            self.last = now
            self.log(self.line(now))

    def _new(self) -> tuple[int, int, int]:
        """(bytes and documents of this run's work, tokens of all): finished units and running ones."""
        run = [sum(c[k] for c in self.running.values()) for k in range(3)]
        return self.run_bytes + run[0], self.run_docs + run[1], self.tokens + run[2]

    def _rates(self, now: float) -> tuple[float, float]:
        dt = max(now - self.t0, 1e-9)
        new_bytes, new_docs, _ = self._new()
        return new_docs / dt, new_bytes / dt

    def _info(self, now: float) -> str:
        docs_s, bytes_s = self._rates(now)
        _, new_docs, tokens = self._new()
        return (f"{self.units}/{self.n_units} units, {self.kept_docs + new_docs:,} docs "
                f"({docs_s:,.0f}/s), {bytes_s / 1e6:.1f} MB/s, {tokens:,} tokens")

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        _, bytes_s = self._rates(now)
        new_bytes, new_docs, tokens = self._new()
        kept = f" ({self.kept_units} kept from an earlier run)" if self.kept_units else ""
        if self.total:
            to_do = self.total - self.kept_bytes
            left = (to_do - new_bytes) / bytes_s if bytes_s > 0 else 0.0
            done = f"{new_bytes / 1e9:.2f} of {to_do / 1e9:.2f} GB of {'new ' if kept else ''}text, "
        else:
            per_unit = (now - self.t0) / max(1, self.units - self.kept_units)
            left, done = per_unit * (self.n_units - self.units), ""
        return (f"prepare: {self.units}/{self.n_units} units{kept}, {self.kept_docs + new_docs:,} docs, "
                f"{done}{bytes_s / 1e6:.1f} MB/s, {tokens:,} tokens, ETA {_eta(left)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.mode == "lines":
            self.log(self.line())
