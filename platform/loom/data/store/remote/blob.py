"""One remote object read by ranged chunks through the node's cache: what a shard reads its
tokens from when the store lives in object storage (a local shard maps its file instead)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from loom.data.store.remote.cache import ChunkCache
from loom.data.store.remote.location import key_of
from loom.data.store.remote.settings import StorageSettings
from loom.data.store.remote.stats import StorageCounters, counters
from loom.data.store.remote.transport import filesystem, retrying

_POOLS: dict[int, tuple[ThreadPoolExecutor, set, threading.Lock]] = {}


def _pool() -> tuple[ThreadPoolExecutor, set, threading.Lock]:
    """This process's prefetch threads and the chunks they are fetching (made after a fork)."""
    import os

    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS[pid] = (ThreadPoolExecutor(4, thread_name_prefix="loom-prefetch"), set(), threading.Lock())
    return _POOLS[pid]


class RemoteBlob:
    """`size` bytes at `url` (version `etag`, pinned at open: a changed object is another cache key)."""

    def __init__(self, url: str, size: int, etag: str, settings: StorageSettings,
                 stats: StorageCounters | None = None) -> None:
        self.url, self.size, self.etag, self.settings = url, int(size), etag, settings
        self.stats = stats or counters()
        self.key = key_of(f"{url}|{etag}|{size}")
        self.cache = ChunkCache(settings.cache_root, settings.cache_max_bytes, self.stats)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled in a loader worker: the rank's counters came along (StorageCounters pickles them
        only into a process being started)."""
        self.__dict__.update(state)
        self.cache = ChunkCache(self.settings.cache_root, self.settings.cache_max_bytes, self.stats)

    def _span(self, n: int) -> tuple[int, int]:
        lo = n * self.settings.chunk_bytes
        return lo, min(self.size, lo + self.settings.chunk_bytes)

    def _fetch(self, n: int) -> bytes:
        lo, hi = self._span(n)

        def ranged() -> bytes:
            got = filesystem(self.url, self.settings).cat_file(self.url, start=lo, end=hi)
            if len(got) != hi - lo:  # a dropped connection mid-body: retried; a short object: refused
                raise ConnectionError(f"{len(got):,} of {hi - lo:,} bytes arrived")
            return got

        data = retrying(f"{self.url} bytes {lo:,}-{hi:,}", ranged, self.settings,
                        on_retry=lambda: self.stats.add("retries"))
        self.stats.add("bytes_fetched", len(data))
        self.stats.add("requests")
        return data

    def chunk(self, n: int) -> bytes:
        lo, hi = self._span(n)
        return self.cache.get(self.key, n, hi - lo, lambda: self._fetch(n))

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of the object; the time spent waiting on storage is counted."""
        if not 0 <= lo <= hi <= self.size:
            raise IndexError(f"bytes [{lo}, {hi}) are outside {self.url} ({self.size:,} bytes)")
        step = self.settings.chunk_bytes
        t0 = time.perf_counter()
        parts = []
        for n in range(lo // step, (hi - 1) // step + 1 if hi > lo else lo // step):
            c_lo = n * step
            parts.append(self.chunk(n)[max(lo, c_lo) - c_lo:min(hi, c_lo + step) - c_lo])
        self.stats.add("wait_s", time.perf_counter() - t0)
        return b"".join(parts)

    def tokens(self, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of a token file of `dtype` (a fresh array)."""
        isz = dtype.itemsize
        return np.frombuffer(self.read(lo * isz, hi * isz), dtype=dtype)

    def prefetch(self, dtype: np.dtype, lo: int, hi: int) -> None:
        """Fetch the chunks holding tokens [lo, hi) in the background (no wait; errors surface when read)."""
        isz, step = dtype.itemsize, self.settings.chunk_bytes
        if hi <= lo:
            return
        pool, pending, lock = _pool()
        for n in range(lo * isz // step, (hi * isz - 1) // step + 1):
            tag = (self.key, n)
            if self.cache.chunk_path(self.key, n).is_file():
                continue
            with lock:
                if tag in pending:
                    continue
                pending.add(tag)
            pool.submit(self._prefetch_one, n, tag)

    def _prefetch_one(self, n: int, tag: tuple) -> None:
        pool, pending, lock = _pool()
        try:
            self.chunk(n)
        except Exception:  # noqa: BLE001 (the read that needs it retries and reports)
            pass
        finally:
            with lock:
                pending.discard(tag)
