"""One shard of a token store, memory-mapped and checked at open in O(1): a Megatron prefix
(`IndexedShard`) or a nanoGPT flat token file (`FlatShard`).

Lookups bisect the mapped index arrays with `bisect` (a Python binary search: O(log n) element
reads). Not `np.searchsorted`: Megatron's arrays sit at unaligned offsets (a 34-byte header), and
numpy copies an unaligned haystack whole before searching it, a full pass per call.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import cached_property
from pathlib import Path

import numpy as np

from loom.data.store.errors import FIX, StoreError
from loom.data.store.megatron import DTYPE_CODES, HEADER, MAGIC, VERSION

_EMPTY = np.zeros(0, np.int64)


def prefix_files(prefix: Path) -> tuple[Path, Path]:
    """(`<prefix>.idx`, `<prefix>.bin`): the suffix is added, never swapped (names may hold dots)."""
    return prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")


def _map(path: Path, dtype: np.dtype, size: int) -> np.ndarray:
    """A read-only map of the whole file (an empty array for an empty file, which mmap refuses)."""
    if size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _Mapped:
    """A shard's tokens, memory-mapped on first use (`bin_path`, `dtype`, `n_tokens` set by the shard)."""

    bin_path: Path
    dtype: np.dtype
    n_tokens: int

    @cached_property
    def _tokens(self) -> np.ndarray:
        return _map(self.bin_path, self.dtype, self.n_tokens * self.dtype.itemsize)

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        """A view of tokens [lo, hi) of this shard (bounds checked by the caller)."""
        return self._tokens[lo:hi]

    def prefetch(self, lo: int, hi: int) -> None:
        """Tokens [lo, hi) will be read soon: nothing to do for a local file (a remote shard fetches)."""

    @property
    def name(self) -> str:
        return Path(self.prefix).name

    def _bin_size(self) -> int | None:
        """The token file's size in bytes; None when it is missing."""
        return self.bin_path.stat().st_size if self.bin_path.is_file() else None


class IndexedShard(_Mapped):
    """A Megatron `.idx`/`.bin` pair. Token offsets are local to the shard."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.idx_path, self.bin_path = prefix_files(prefix)
        self._open_index()

    def _open_index(self) -> None:
        """Map `idx_path` and check it and the token file's size (O(1) reads)."""
        idx_size = self.idx_path.stat().st_size
        if idx_size < HEADER.size:
            raise StoreError(f"{self.idx_path}: truncated index: {idx_size} bytes, shorter than the "
                             f"{HEADER.size}-byte header of Megatron's indexed format: {FIX}.")
        with open(self.idx_path, "rb") as f:
            magic, version, code, n_seqs, n_entries = HEADER.unpack(f.read(HEADER.size))
        self._check_header(magic, version, code)
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.n_seqs = n_seqs
        self.n_docs = n_entries - 1
        self._check_index_size(idx_size, n_seqs, n_entries)
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        at = HEADER.size
        self.lengths = np.frombuffer(raw, np.int32, n_seqs, at)
        self.pointers = np.frombuffer(raw, np.int64, n_seqs, at + 4 * n_seqs)
        self.doc_index = np.frombuffer(raw, np.int64, n_entries, at + 12 * n_seqs)
        self._check_doc_index()
        self.n_tokens = self._check_bin_size()

    def __reduce__(self) -> tuple:
        """Pickle as the prefix (reopened and rechecked), never the mapped arrays' bytes."""
        return (IndexedShard, (self.prefix,))

    def _check_header(self, magic: bytes, version: int, code: int) -> None:
        where = f"{self.idx_path}: not a Megatron index"
        if magic != MAGIC:
            raise StoreError(f"{where}: its first bytes are {magic!r}, not {MAGIC!r}. Point at a store written "
                             f"by `loom data prepare` or Megatron's tools, or {FIX}.")
        if version != VERSION:
            raise StoreError(f"{where}: version {version}, only version {VERSION} exists: {FIX}.")
        if code not in DTYPE_CODES:
            known = ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPE_CODES.items())
            raise StoreError(f"{where}: unknown dtype code {code} (known: {known}): {FIX}.")

    def _check_index_size(self, size: int, n_seqs: int, n_entries: int) -> None:
        """Header counts against the file size; a trailing int8 modes array (multimodal) is accepted."""
        expected = HEADER.size + 12 * n_seqs + 8 * n_entries
        if n_entries < 1 or size not in (expected, expected + n_seqs):
            raise StoreError(
                f"{self.idx_path}: the index is {size:,} bytes, but its header ({n_seqs:,} sequences, "
                f"{n_entries:,} document-index entries) needs {expected:,} bytes "
                f"(or {expected + n_seqs:,} with multimodal modes): truncated or corrupt: {FIX}.")

    def _check_doc_index(self) -> None:
        first, last = int(self.doc_index[0]), int(self.doc_index[-1])
        if first != 0 or last != self.n_seqs:
            raise StoreError(f"{self.idx_path}: corrupt document index: it runs from {first} to {last}, "
                             f"must run from 0 to the sequence count {self.n_seqs:,}: {FIX}.")

    def _check_bin_size(self) -> int:
        """The .bin must end where the last sequence does; returns the shard's token count."""
        isz = self.dtype.itemsize
        end = 0
        if self.n_seqs:
            first, last = int(self.pointers[0]), int(self.pointers[-1])
            end = last + int(self.lengths[-1]) * isz
            if first != 0 or last % isz or end < last:
                raise StoreError(f"{self.idx_path}: corrupt sequence pointers (first {first}, last {last}, "
                                 f"{self.dtype.name} tokens of {isz} bytes): {FIX}.")
        size = self._bin_size()
        if size is None:
            raise StoreError(f"{self.bin_path}: missing: the index {self.idx_path.name} beside it expects "
                             f"{end:,} bytes of tokens there: {FIX}.")
        if size != end:
            raise StoreError(
                f"{self.bin_path}: {size:,} bytes, but {self.idx_path.name} says {end:,} bytes "
                f"({end // isz:,} {self.dtype.name} tokens): {'truncated' if size < end else 'too long'}: {FIX}.")
        return end // isz

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        """Local token offsets s of document starts with lo < s < hi, sorted and unique (empty
        documents share their successor's start; one past the shard's last token is no start)."""
        isz = self.dtype.itemsize
        lo, hi = max(lo, -1), min(hi, self.n_tokens)
        if hi <= lo + 1:
            return _EMPTY
        first_seq = bisect_right(self.pointers, lo * isz)
        end_seq = bisect_left(self.pointers, hi * isz)
        d0 = bisect_left(self.doc_index, first_seq)
        d1 = bisect_left(self.doc_index, end_seq)
        if d1 <= d0:
            return _EMPTY
        return np.unique(self.pointers[self.doc_index[d0:d1]] // isz)

    def doc_at(self, offset: int) -> int:
        """The shard's document (0-based) holding local token `offset`."""
        seq = bisect_right(self.pointers, offset * self.dtype.itemsize) - 1
        return bisect_right(self.doc_index, seq) - 1


class FlatShard(_Mapped):
    """A nanoGPT-style token file: tokens of one dtype back to back, no document boundaries."""

    n_docs = None

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.prefix = self.bin_path = path
        self.dtype = dtype
        self.n_tokens = self._whole_tokens(path.stat().st_size)

    def _whole_tokens(self, size: int) -> int:
        """The file's token count; a size that is not whole tokens is refused."""
        path, dtype = self.bin_path, self.dtype
        if size % dtype.itemsize:
            raise StoreError(
                f"{path}: {size:,} bytes is not a whole number of {dtype.name} tokens ({dtype.itemsize} bytes "
                f"each; the nearest sizes are {size - size % dtype.itemsize:,} and "
                f"{size - size % dtype.itemsize + dtype.itemsize:,}): truncated, or not a flat token file of "
                f"this dtype (set the dtype the file was written with, e.g. uint32), or {FIX}.")
        return size // dtype.itemsize

    def __reduce__(self) -> tuple:
        return (FlatShard, (self.bin_path, self.dtype))

    def doc_starts(self, lo: int, hi: int) -> np.ndarray:
        return _EMPTY

    def doc_at(self, offset: int) -> int:
        return 0


def check_dtypes_agree(shards: list[IndexedShard], where: Path) -> np.dtype | None:
    """The shards' one dtype (None for no shards); a store mixing dtypes cannot be one stream."""
    kinds = {s.dtype for s in shards}
    if len(kinds) > 1:
        found = ", ".join(f"{s.name}: {s.dtype.name}" for s in shards[:8])
        raise StoreError(f"{where}: its shards hold different token dtypes ({found}); one store is one stream "
                         "of one dtype: prepare the shards with the same tokenizer, or list them as separate "
                         "sources of a mixture.")
    return next(iter(kinds), None)
