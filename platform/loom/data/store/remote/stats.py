"""The node's storage counters: bytes fetched, cache hits and misses, evictions, retries and the
time a reader blocked on a fetch. One shared array per rank, made in the rank's process before its
loader forks its workers, which inherit it with the dataset, so a worker's fetches count where the
training loop reads them (summary.json `storage`, the data-wait cause). A worker started by spawn
counts in its own (not summed): its shards are pickled without the shared array."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

FIELDS = ("bytes_fetched", "requests", "hits", "misses", "evictions", "retries", "uncached", "wait_s",
          "index_bytes")
_COUNTERS: dict[int, Any] = {}


class StorageCounters:
    """A shared array of FIELDS, inherited by the loader workers a rank forks."""

    def __init__(self) -> None:
        # fork's context: an unnamed semaphore, which no resource tracker warns about when a rank dies;
        # it reaches a loader worker started by fork (Linux's default), and only such a worker
        self._values = multiprocessing.get_context("fork").Array("d", len(FIELDS))

    def add(self, field: str, amount: float = 1.0) -> None:
        i = FIELDS.index(field)
        with self._values.get_lock():
            self._values[i] += amount

    def snapshot(self) -> dict[str, float]:
        with self._values.get_lock():
            return dict(zip(FIELDS, self._values[:], strict=True))


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
