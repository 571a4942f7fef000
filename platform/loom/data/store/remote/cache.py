"""The node's chunk cache: fixed-size pieces of remote objects as files under one folder, shared by
every process on the node, capped in bytes, least recently used evicted first.

Written by hand because no maintained cache gives all three of: a byte cap that holds across
processes, one download per chunk per node, and never deleting a chunk a reader holds (fsspec's
block caches are per process and uncapped; MosaicML streaming's limits deadlocked or deleted data:
streaming #339, #417, #988). It keeps to file locks (`flock`) and renames:

- a chunk file appears whole (written beside, then renamed) and is read under a shared lock;
- a download holds the chunk's own lock file, so a second process waits for it instead of fetching;
- space is made under the cache's one lock: the bytes of every file under the folder (indexes too)
  plus the new chunk stay within `max_bytes`; a chunk is evicted only when its exclusive lock is
  free (no reader holds it). A chunk that finds no room is served uncached, never over the cap.
  A ledger file holds the bytes in use, so a write below the cap stats nothing; at the cap one
  scan of the folder corrects the ledger and evicts a tenth of the cap beyond what is needed, so
  the next writes need no scan either;
- the folder outlives the run: a restarted run reads what is there (recency = modification time).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from loom.data.store.remote.stats import StorageCounters

CHUNKS, INDEX, LOCKS, SPACE_LOCK, LEDGER = "chunks", "index", "locks", ".space.lock", ".used-bytes"
STAGING = "staging"  # `loom data prepare --out URL`'s shards before upload: beside the cache, not in its cap


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


class ChunkCache:
    def __init__(self, root: Path, max_bytes: int, counters: StorageCounters) -> None:
        self.root, self.max_bytes, self.counters = Path(root), int(max_bytes), counters

    def chunk_path(self, obj: str, n: int) -> Path:
        return self.root / CHUNKS / obj / f"{n:08d}"

    def get(self, obj: str, n: int, size: int, fetch: Callable[[], bytes]) -> bytes:
        """Chunk `n` of object `obj` (`size` bytes): from the cache, else fetched once per node."""
        path = self.chunk_path(obj, n)
        data = self._read(path, size)
        if data is not None:
            self.counters.add("hits")
            return data
        with _locked(self.root / LOCKS / obj / f"{n:08d}", fcntl.LOCK_EX):
            data = self._read(path, size)  # another process fetched it while this one waited
            if data is not None:
                self.counters.add("hits")
                return data
            self.counters.add("misses")
            data = fetch()
            self.put(path, data)
        return data

    def whole(self, obj: str, name: str, fetch: Callable[[], bytes]) -> Path:
        """A whole small object (an index), fetched once and kept: never evicted, counted in the cap."""
        path = self.root / INDEX / obj / name
        if path.is_file():
            return path
        with _locked(self.root / LOCKS / obj / f"{name}.lock", fcntl.LOCK_EX):
            if not path.is_file():
                data = fetch()
                self.counters.add("index_bytes", len(data))
                if not self.put(path, data):
                    raise OSError(errno.ENOSPC, f"the cache {self.root} has no room for the index {name} "
                                  f"({len(data):,} bytes) within dataset.cache.max_gb; raise it")
        return path

    @staticmethod
    def _read(path: Path, size: int) -> bytes | None:
        """The chunk's bytes under a shared lock (an evictor skips it meanwhile); None when absent,
        evicted while opening, or not `size` bytes long."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:
                return None
            data = os.read(fd, size + 1)
            while len(data) < size + 1:
                more = os.read(fd, size + 1 - len(data))
                if not more:
                    break
                data += more
            if len(data) != size:
                return None
            os.utime(fd)  # recency for eviction
            return data
        finally:
            os.close(fd)

    def put(self, path: Path, data: bytes) -> bool:
        """Store `data` at `path` if room can be made within the cap; False (served uncached) if not."""
        with _locked(self.root / SPACE_LOCK, fcntl.LOCK_EX):
            if not self._make_room(len(data)):
                self.counters.add("uncached")
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return True

    def used_bytes(self) -> int:
        return sum(size for size, _, _ in self._files())

    def _files(self) -> list[tuple[int, float, Path]]:
        """(size, modification time, path) of every file under the cache folder but the ledger and
        a prepare's staging folder (transient, and not the reader's to evict)."""
        out = []
        for dirpath, dirs, names in os.walk(self.root):
            if Path(dirpath) == self.root and STAGING in dirs:
                dirs.remove(STAGING)
            for name in names:
                if name.startswith(LEDGER):  # the ledger's few digits are not cache contents
                    continue
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_size, st.st_mtime, p))
        return out

    def _make_room(self, need: int) -> bool:
        """Room for `need` more bytes within the cap (under the space lock): the ledger says so, or
        a scan evicts least recently used chunks no reader holds, down to a tenth below the cap."""
        used = self._ledger()
        if used is not None and used + need <= self.max_bytes:
            self._set_ledger(used + need)
            return True
        files = self._files()
        used = sum(size for size, _, _ in files)
        target = self.max_bytes - need - self.max_bytes // 10
        chunks = self.root / CHUNKS
        if used > target:
            for size, _, path in sorted((f for f in files if chunks in f[2].parents), key=lambda f: f[1]):
                if self._evict(path):
                    used -= size
                    self.counters.add("evictions")
                    if used <= target:
                        break
        fits = used + need <= self.max_bytes
        self._set_ledger(used + need if fits else used)
        return fits

    def _ledger(self) -> int | None:
        try:
            return int((self.root / LEDGER).read_text())
        except (OSError, ValueError):
            return None

    def _set_ledger(self, used: int) -> None:
        tmp = self.root / f"{LEDGER}.tmp"
        tmp.write_text(str(used))
        os.replace(tmp, self.root / LEDGER)

    @staticmethod
    def _evict(path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            path.unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)
