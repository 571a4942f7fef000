"""The loader's share of the step (issue 37): `perf/data_wait_pct` per log window, and one
WARNING for the whole run when the training loop waited for its batches more than 5% of a window.

A starving loader is invisible in the loss and hides in tokens/s as "a slow model"; the share
names it. The percentage is the logged row's own two means over ranks (`perf/data_wait_ms` over
`perf/step_time_ms`), so the three columns of metrics.csv agree. An attempt's first window is
left out of the rule and of the maximum: it holds the loader's start-up (workers forking, files
opening, the first prefetch), which a run pays once. Validation and checkpoint saves are in
neither the window's step time nor its data wait (loom.tracking.recorder), so they cannot trip
it. Rank 0 only, from the row the recorder logs anyway: no collective and no file of its own.
summary.json `data_wait` {max_window_pct, max_window_step, warned_at_step, cause, threshold_pct}.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("loom")

THRESHOLD_PCT = 5.0  # issue 37: "data wait under 5% of step time"
IN_PROCESS = "hardware.dataloader_workers=0"
WORKERS = "workers, storage or tokenizing"
STORAGE = "object storage"  # the readers blocked on remote fetches for at least half the wait


def window_pct(data_wait_ms: float, step_time_ms: float) -> float:
    """100 x data wait / step time of one window (0 for a window without time)."""
    return 100.0 * data_wait_ms / step_time_ms if step_time_ms > 0 else 0.0


def loader_workers(trainer: Any) -> int | None:
    """The training DataLoader's worker processes as it runs (None: not a DataLoader, or no
    loader yet); read from the loader rather than the config, since a datamodule decides."""
    loader = getattr(trainer, "train_dataloader", None)
    workers = getattr(loader, "num_workers", None)
    return workers if isinstance(workers, int) else None


def advice(cause: str, workers: int | None) -> str:
    """What the warning says after the figure: the likely cause and what to change."""
    if cause == STORAGE:
        return ("its readers waited on object storage (perf/storage_wait_ms): raise dataset.cache.prefetch, "
                "dataset.cache.max_gb so the working set stays cached, or hardware.dataloader_workers")
    if cause == IN_PROCESS:
        return ("with hardware.dataloader_workers=0 the batches are read and collated in the training process; "
                "raise hardware.dataloader_workers")
    them = f"its {workers} workers" if workers else "its workers"
    return (f"the loader ({them}) cannot keep up: more hardware.dataloader_workers, faster storage, "
            "or prepare the data with `loom data prepare`")


class DataWaitWatch:
    """Rank 0: the largest window share of the run, and the warning, said once per run (a
    resumed attempt carries the earlier attempts' record: `carry`)."""

    def __init__(self) -> None:
        self.workers: int | None = None
        self.first = True                   # the attempt's next window is its first (loader start-up)
        self.max_pct: float | None = None
        self.max_step: int | None = None    # the log step that closed that window
        self.warned_at: int | None = None
        self.cause: str | None = None
        self.storage = StorageWait()        # every rank: its readers' wait on object storage per window

    def start(self, workers: int | None) -> None:
        """A training loop starts (`on_train_start`): its first window is the loader's start-up."""
        self.workers, self.first = workers, True

    def carry(self, earlier: dict[str, Any] | None) -> None:
        """An earlier attempt's summary.json `data_wait`: its maximum, and its warning (not said again)."""
        if not earlier:
            return
        self.max_pct, self.max_step = earlier.get("max_window_pct"), earlier.get("max_window_step")
        self.warned_at, self.cause = earlier.get("warned_at_step"), earlier.get("cause")

    def window_row(self, begins: int, step: int, row: dict[str, float]) -> None:
        """`window` from a logged row (perf/data_wait_pct, perf/storage_wait_ms, perf/data_wait_ms)."""
        self.window(begins, step, row["perf/data_wait_pct"], storage_ms=row.get("perf/storage_wait_ms", 0.0),
                    data_ms=row["perf/data_wait_ms"])

    def window(self, begins: int, step: int, pct: float, storage_ms: float = 0.0, data_ms: float = 0.0) -> None:
        """The window (begins, step] closed with `pct` of its step time waiting for data, of which
        `storage_ms` per step (of `data_ms`) the readers blocked on object storage."""
        if self.first:
            self.first = False
            return
        if self.max_pct is None or pct > self.max_pct:
            self.max_pct, self.max_step = pct, step
        if pct > THRESHOLD_PCT and self.warned_at is None:
            cause = IN_PROCESS if self.workers == 0 else WORKERS
            self.warned_at, self.cause = step, STORAGE if data_ms > 0 and storage_ms >= data_ms / 2 else cause
            log.warning(f"Data wait: the training loop waited {pct:.1f}% of steps {begins + 1}-{step} for its "
                        f"batches (over {THRESHOLD_PCT:g}%): {advice(self.cause, self.workers)} "
                        "(summary.json data_wait, metrics perf/data_wait_pct)")

    def summary(self) -> dict[str, Any]:
        """summary.json `data_wait` (max_window_pct null: no window after the first was logged)."""
        return {"max_window_pct": None if self.max_pct is None else round(self.max_pct, 2),
                "max_window_step": self.max_step, "warned_at_step": self.warned_at, "cause": self.cause,
                "threshold_pct": THRESHOLD_PCT}


class StorageWait:
    """The seconds a rank's readers (its loader workers included) blocked on object storage, per
    log window: `stats` is the rank's counters (loom.data.storage_stats, set by the worker; None, or
    returning None, without a remote store)."""

    def __init__(self) -> None:
        self.stats = None
        self.at_last = 0.0

    def take(self) -> float:
        """Seconds waited since the last call (0 without a remote store)."""
        now = self.stats() if self.stats is not None else None
        if not now:
            return 0.0
        total = float(now["wait_s"])
        waited, self.at_last = total - self.at_last, total
        return max(0.0, waited)
