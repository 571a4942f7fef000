"""The rank's storage counters: bytes fetched, cache hits and misses, evictions, retries and the
time a reader blocked on a fetch. One shared array per rank, made in the rank's process before its
loader starts workers and handed to them with the dataset, so a worker's fetches count where the
training loop reads them (summary.json `storage`, the data-wait cause).

Lock-free: each process adds to its own row (`claim_row`: the rank's process row 0, a loader worker
the row its loader's `worker_init_fn` gives it), and a snapshot sums the rows. A lock would be a
named semaphore (loader workers start by forkserver under torchrun), which the resource tracker
reports as leaked whenever a rank dies."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import threading
from typing import Any

FIELDS = ("bytes_fetched", "requests", "hits", "misses", "evictions", "retries", "uncached", "wait_s",
          "index_bytes")
ROWS = 64  # the rank's process, and its loaders' workers (wrapping around past 63)
_COUNTERS: dict[int, Any] = {}
_ROW = {"row": 0}
_ADDING = threading.Lock()  # the rank's prefetch threads share its row


def claim_row(row: int) -> None:
    """This process adds to row `row` (a loader worker's `worker_init_fn`)."""
    _ROW["row"] = row % ROWS


class StorageCounters:
    """ROWS x FIELDS doubles in shared memory; travels into a process being started (a loader worker)."""

    def __init__(self) -> None:
        self._values = multiprocessing.get_context("spawn").RawArray("d", ROWS * len(FIELDS))

    def __getstate__(self) -> dict[str, Any]:
        if multiprocessing.context.get_spawning_popen() is None:  # a copy, not a process start
            return {"_values": None}
        return {"_values": self._values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._values = state["_values"]
        if self._values is None:
            self._values = multiprocessing.get_context("spawn").RawArray("d", ROWS * len(FIELDS))

    def add(self, field: str, amount: float = 1.0) -> None:
        i = _ROW["row"] * len(FIELDS) + FIELDS.index(field)
        with _ADDING:
            self._values[i] += amount

    def snapshot(self) -> dict[str, float]:
        values = self._values[:]
        n = len(FIELDS)
        return {f: sum(values[r * n + k] for r in range(ROWS)) for k, f in enumerate(FIELDS)}


def counters() -> StorageCounters:
    """This process's counters (a loader worker uses its rank's, carried by the shards it reads)."""
    pid = os.getpid()
    if pid not in _COUNTERS:
        _COUNTERS[pid] = StorageCounters()
    return _COUNTERS[pid]


def in_use() -> dict[str, float] | None:
    """This process's counters, or None where it opened no remote store."""
    c = _COUNTERS.get(os.getpid())
    return None if c is None else c.snapshot()
