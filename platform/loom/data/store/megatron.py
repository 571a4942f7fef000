"""Megatron's indexed format (megatron/core/datasets/indexed_dataset.py), written without torch.

A shard is `<prefix>.bin` (the tokens back to back) and `<prefix>.idx`: header `MMIDIDX\\x00\\x00`,
`<Q` version 1, `<B` dtype code, `<Q` sequence count, `<Q` document-index count (documents + 1),
then int32 sequence lengths, int64 byte pointers, int64 document indices (sequence numbers,
starting at 0), and optionally int8 modes (multimodal). Loom writes one sequence per document,
as Megatron's `preprocess_data.py` does without sentence splitting; the bytes equal what
megatron.core's `IndexedDatasetBuilder` writes for the same documents (tests check it).
"""

from __future__ import annotations

import struct
from array import array
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from loom.atomic import atomic_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document-index entries
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_CHUNK = 1 << 20  # index entries written per slice, so finishing a big shard stays small in memory
_MAX_LEN = np.iinfo(np.int32).max


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """The narrowest dtype Megatron would pick: uint16 below 65500 ids, else int32; None is
    byte-level (ids < 256), stored as uint8 (Megatron itself would pick int32 there)."""
    if vocab_size is None:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def dtype_code(dtype: np.dtype | type | str) -> int:
    """Megatron's code for `dtype`; ValueError naming the ones the format has."""
    code = CODE_OF.get(np.dtype(dtype))
    if code is None:
        names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise ValueError(f"dtype {np.dtype(dtype).name} has no code in Megatron's indexed format ({names})")
    return code


def _as_tokens(ids: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`ids` as a C-contiguous `dtype` array; refuses ids the dtype cannot hold (a silent wrap
    would corrupt the corpus where Megatron's writer would not notice)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"a document is a 1-D array of token ids, got shape {arr.shape}")
    if arr.dtype == dtype or arr.size == 0:
        return np.ascontiguousarray(arr, dtype=dtype)
    if dtype.kind in "iu" and not np.can_cast(arr.dtype, dtype):
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got {arr.dtype}")
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise ValueError(f"token id {bad} does not fit the shard's dtype {dtype.name} "
                             f"([{info.min}, {info.max}]): pick it with optimal_dtype(vocab_size)")
    return np.ascontiguousarray(arr, dtype=dtype)


class ShardWriter(AbstractContextManager):
    """Write one Megatron prefix. Tokens stream to a temporary .bin; `finish` renames it into
    place and then writes the .idx (also temp + rename), so a shard is complete iff its .idx
    exists. As a context manager it finishes on success and leaves nothing on an exception."""

    def __init__(self, prefix: Path | str, dtype: np.dtype | type | str) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self.code = dtype_code(self.dtype)
        self.bin_path = self.prefix.with_name(self.prefix.name + ".bin")
        self.idx_path = self.prefix.with_name(self.prefix.name + ".idx")
        self.n_tokens = 0
        self._lengths = array("i")
        assert self._lengths.itemsize == 4, "array('i') must be int32 for the .idx lengths"
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_cm = atomic_path(self.bin_path)
        self._file: BinaryIO | None = open(self._bin_cm.__enter__(), "wb")  # noqa: SIM115 (closed in finish/abort)

    @property
    def n_docs(self) -> int:
        return len(self._lengths)

    def add_document(self, ids: np.ndarray) -> None:
        """Append one document as one sequence."""
        if self._file is None:
            raise ValueError(f"{self.prefix}: add_document after finish/abort")
        arr = _as_tokens(ids, self.dtype)
        if arr.size > _MAX_LEN:
            raise ValueError(f"a document of {arr.size} tokens exceeds the format's int32 sequence length")
        self._file.write(arr.data)
        self._lengths.append(arr.size)
        self.n_tokens += arr.size

    def finish(self) -> None:
        """Rename the .bin into place, then write the .idx; on failure neither is left."""
        if self._file is None:
            raise ValueError(f"{self.prefix}: finish called twice or after abort")
        self._file.close()
        self._file = None
        self._bin_cm.__exit__(None, None, None)
        try:
            with atomic_path(self.idx_path) as tmp, open(tmp, "wb") as f:
                self._write_index(f)
        except BaseException:
            self.bin_path.unlink(missing_ok=True)
            raise

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the temporary .bin (nothing of this shard stays on disk)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        err = exc if exc is not None else RuntimeError("shard aborted")
        self._bin_cm.__exit__(type(err), err, err.__traceback__)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.abort(exc)
        elif self._file is not None:
            self.finish()

    def _write_index(self, f: BinaryIO) -> None:
        """Header, lengths, pointers, document indices: Megatron's _IndexWriter byte for byte."""
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        n = lengths.size
        f.write(HEADER.pack(MAGIC, VERSION, self.code, n, n + 1))
        f.write(lengths.data)
        offset = 0
        for lo in range(0, n, _CHUNK):
            chunk = lengths[lo:lo + _CHUNK].astype(np.int64) * self.dtype.itemsize
            ends = np.cumsum(chunk) + offset
            f.write((ends - chunk).data)
            offset = int(ends[-1])
        for lo in range(0, n + 1, _CHUNK):
            f.write(np.arange(lo, min(lo + _CHUNK, n + 1), dtype=np.int64).data)
