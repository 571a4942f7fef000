"""Documents out of one work unit, in order: a `str` per document, None for an empty or
missing one, a `NotUtf8` (where it is) for one that is not valid UTF-8. The worker counts the
last two and skips them (or, with --strict, refuses the first non-UTF-8 one).

A `Cursor` passed along says where the last document came from (to name a refused one) and how
much of the unit's input is read (progress within a unit: text bytes of JSON lines and CSV,
compressed or not; a file's size on disk; a share of the unit by rows for parquet and datasets).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loom.data.prepare.workunit import InputUnit
from loom.errors import ConfigError

ROWS = 1000  # rows per batch read from parquet and datasets


@dataclass(frozen=True)
class NotUtf8:
    where: str  # "<file> at byte N" or "<file> row N"


Doc = str | None | NotUtf8


@dataclass
class Cursor:
    """Where a unit's reader is: `where` names the last document, `done` is the input read so far
    (in the unit's own measure, up to `unit.bytes`)."""

    where: str = ""
    done: int = 0


def open_binary(path: Path | str) -> BinaryIO:
    """A buffered binary reader of the file's content: gzip and zstandard (.zst, through
    pyarrow, as the zstandard package is not a dependency) decompressed."""
    name = str(path)
    if name.endswith(".gz"):
        return gzip.open(name, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        import pyarrow as pa

        return io.BufferedReader(pa.CompressedInputStream(pa.OSFile(name), "zstd"), 1 << 20)
    return open(name, "rb")


def csv_header(path: Path) -> list[str]:
    """The first record of a CSV file (its column names)."""
    with open_binary(path) as f:
        text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
        return next(csv.reader(text), [])


def parquet_file(path: Path) -> Any:
    """A pyarrow ParquetFile (a compressed file is decompressed into memory first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.name.endswith((".gz", ".zst")):
        with open_binary(path) as f:
            return pq.ParquetFile(pa.BufferReader(f.read()))
    return pq.ParquetFile(str(path))


def _value(v: Any, where: str) -> Doc:
    """A field's value as a document: str as is, bytes decoded, others str()'d, None absent."""
    if v is None:
        return None
    if isinstance(v, bytes):
        try:
            v = v.decode("utf-8")
        except UnicodeDecodeError:
            return NotUtf8(where)
    elif not isinstance(v, str):
        v = str(v)
    return v or None


def files_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    """One document per file (decompressed when .gz / .zst); progress counts files' sizes on disk."""
    for p in unit.paths:
        with open_binary(p) as f:
            raw = f.read()
        cur.where = p
        cur.done += Path(p).stat().st_size
        try:
            yield raw.decode("utf-8") or None
        except UnicodeDecodeError as e:
            yield NotUtf8(f"{p} at byte {e.start}")


def skip_to(f: BinaryIO, start: int, compressed: bool) -> None:
    """Move a reader to `start`: a seek, or for a compressed stream (no random access in gzip or
    zstd) reading and dropping what comes before; units/scan say why that costs little."""
    if not compressed:
        f.seek(start)
        return
    left = start
    while left > 0:
        block = f.read(min(left, 1 << 22))
        if not block:
            return
        left -= len(block)


def _range_lines(f: BinaryIO, start: int, stop: int, compressed: bool) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines starting in [start, stop) (stop -1: to the end); offsets are
    in the decompressed text."""
    if start:
        skip_to(f, start, compressed)
    pos = start
    for line in f:
        if stop >= 0 and pos >= stop:
            return
        yield pos, line
        pos += len(line)


def is_compressed(path: str | Path) -> bool:
    return str(path).endswith((".gz", ".zst"))


def jsonl_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    path = unit.paths[0]
    with open_binary(path) as f:
        for pos, raw in _range_lines(f, unit.start, unit.stop, is_compressed(path)):
            cur.where, cur.done = f"{path} at byte {pos}", pos + len(raw) - unit.start
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield NotUtf8(f"{path} at byte {pos + e.start}")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"Invalid input: {path} at byte {pos} is not a JSON line ({e}); "
                                  ".json/.jsonl inputs hold one JSON object per line.") from None
            doc = _value(rec.get(unit.field) if isinstance(rec, dict) else None, f"{path} at byte {pos}")
            if isinstance(doc, str):
                try:
                    doc.encode("utf-8")  # a \ud800 escape decodes to a lone surrogate
                except UnicodeEncodeError:
                    doc = NotUtf8(f"{path} at byte {pos}")
            yield doc


class _Lines:
    """Decoded lines for csv.reader that remember where the current record's lines began;
    undecodable bytes become surrogates, found later in the field that holds them."""

    def __init__(self, lines: Iterator[tuple[int, bytes]]) -> None:
        self.lines, self.starts, self.end = lines, [], 0

    def __iter__(self) -> Iterator[str]:
        for pos, raw in self.lines:
            self.starts.append(pos)
            self.end = pos + len(raw)
            yield raw.decode("utf-8", errors="surrogateescape")


def csv_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    path = unit.paths[0]
    col = csv_header(Path(path)).index(unit.field)
    with open_binary(path) as f:
        lines = _Lines(_range_lines(f, unit.start, unit.stop, is_compressed(path)))
        reader = csv.reader(lines)
        if unit.start == 0:
            next(reader, None)  # the header
            lines.starts.clear()
        for row in reader:
            where = f"{path} at byte {lines.starts[0] if lines.starts else unit.start}"
            lines.starts.clear()
            cur.where, cur.done = where, lines.end - unit.start
            doc = _value(row[col] if col < len(row) else None, where)
            if isinstance(doc, str):
                try:
                    doc.encode("utf-8")
                except UnicodeEncodeError:
                    doc = NotUtf8(where)
            yield doc


def parquet_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    path = unit.paths[0]
    pf = parquet_file(Path(path))
    groups = list(range(unit.start, pf.metadata.num_row_groups if unit.stop < 0 else unit.stop))
    row = sum(pf.metadata.row_group(i).num_rows for i in range(groups[0])) if groups else 0
    first, rows = row, max(1, sum(pf.metadata.row_group(i).num_rows for i in groups))
    for batch in pf.iter_batches(batch_size=ROWS, row_groups=groups, columns=[unit.field]) if groups else []:
        for v in batch.column(0).to_pylist():
            cur.where, cur.done = f"{path} row {row}", unit.bytes * (row + 1 - first) // rows
            yield _value(v, cur.where)
            row += 1


def _rows(ds: Any, field: str, start: int, stop: int) -> Iterator[tuple[int, Any]]:
    col = ds.select_columns([field])
    for a in range(start, stop, ROWS):
        yield from enumerate(col[a : min(stop, a + ROWS)][field], start=a)


def _at_row(cur: Cursor, unit: InputUnit, where: str, i: int) -> str:
    cur.where, cur.done = where, unit.bytes * (i + 1 - unit.start) // max(1, unit.stop - unit.start)
    return where


def hf_dir_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    import datasets

    path = Path(unit.paths[0])
    ds = datasets.load_from_disk(str(path / unit.split if unit.split else path))
    for i, v in _rows(ds, unit.field, unit.start, unit.stop):
        yield _value(v, _at_row(cur, unit, f"{path} row {i}", i))


def hf_rows_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    """Rows of a dataset reloaded by its spec: row i is kept when it falls in the wanted split
    (as loom.data.prepare.hf_source.docs chooses)."""
    from omegaconf import OmegaConf

    from loom.data.prepare.hf_source import load

    ds = load(OmegaConf.create(unit.load_spec))
    k = unit.val_every
    for i, v in _rows(ds, unit.field, unit.start, unit.stop):
        if (k > 1 and i % k == k - 1) == unit.want_val:
            yield _value(v, _at_row(cur, unit, f"{unit.paths[0]} row {i}", i))


def _lines_docs(unit: InputUnit, cur: Cursor) -> Iterator[Doc]:
    return jsonl_docs(unit, cur) if unit.fmt == "jsonl" else csv_docs(unit, cur)


READERS = {"files": files_docs, "lines": _lines_docs, "parquet": parquet_docs, "hf_dir": hf_dir_docs,
           "hf_rows": hf_rows_docs}


def unit_docs(unit: InputUnit, cursor: Cursor | None = None) -> Iterator[Doc]:
    return READERS[unit.kind](unit, cursor if cursor is not None else Cursor())
