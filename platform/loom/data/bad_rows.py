"""Where a local data file the `datasets` library could not read goes wrong, in one paragraph.

The library's error for a malformed JSON line, a ragged CSV record or a damaged parquet file is an
~90-line pyarrow traceback that names neither the file nor the row. When a load fails, each file is
read again here, plainly (JSON line by line, CSV record by record, parquet by row group), and the
first row that does not parse is named with the parser's own message; the library's first line is
the fallback when every row parses (e.g. a column whose type changes between rows).
Written by hand because no library reports it this way; it runs only after a load has failed.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from loom.errors import ConfigError


def _json(path: Path) -> str | None:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        whole = json.loads(text)  # a .json file may be one document (a list of rows)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list):
        bad = next((i for i, r in enumerate(whole) if not isinstance(r, dict)), None)
        return None if bad is None else f"element {bad} of its list is a {type(whole[bad]).__name__}, not an object"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {n} is not JSON ({e.msg} at column {e.colno}: {line[:60]!r})"
        if not isinstance(row, dict):
            return f"line {n} is a JSON {type(row).__name__}, not an object"
    return None


def _csv(path: Path) -> str | None:
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, [])
            for row in reader:
                if row and len(row) != len(header):
                    return (f"record at line {reader.line_num} has {len(row)} fields where the header has "
                            f"{len(header)}")
        except csv.Error as e:
            return f"line {reader.line_num}: {e}"
    return None


def _parquet(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
        for g in range(pf.metadata.num_row_groups):
            try:
                pf.read_row_group(g)
            except Exception as e:  # pyarrow's errors: one line of its own
                rows = sum(pf.metadata.row_group(i).num_rows for i in range(g))
                return f"row group {g} (rows from {rows}) cannot be read: {_first_line(e)}"
    except Exception as e:
        return f"is not a readable parquet file: {_first_line(e)}"
    return None


def _text(path: Path) -> str | None:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start})"
    return None


READERS = {".json": _json, ".jsonl": _json, ".csv": _csv, ".parquet": _parquet, ".txt": _text}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def unreadable(key: str, value: str, files: list[Path], error: BaseException) -> ConfigError:
    """The refusal of `files` (`key`=`value`) the library failed on with `error`."""
    for f in files:
        where = READERS.get(f.suffix, lambda p: None)(f)
        if where:
            return ConfigError(f"Invalid input: {key}={value}: {f} {where}. Fix or remove that row; nothing "
                               "was written.")
    return ConfigError(f"Invalid input: {key}={value}: the datasets library could not read it "
                       f"({type(error).__name__}: {_first_line(error)}); nothing was written.")
