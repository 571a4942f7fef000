"""What the inputs are, before any work: the files a pattern matches, each file's kind, the
text field checked against the first record's fields, and where a big file may be cut.

Everything here refuses bad input with ConfigError before anything is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

from loom.data.files import expand
from loom.data.prepare.readers import csv_header, open_binary, parquet_file
from loom.errors import ConfigError

FORMATS = {".jsonl": ("lines", "jsonl"), ".json": ("lines", "jsonl"), ".csv": ("lines", "csv"),
           ".parquet": ("parquet", "")}


def is_saved_dataset(p: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file())


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Every input, absolute, deduplicated and sorted; a pattern that matches nothing, or a
    directory that is not a saved dataset, is refused naming it."""
    found: set[Path] = set()
    for pattern in inputs:
        p = Path(pattern).expanduser()
        if p.is_dir():
            if not is_saved_dataset(p):
                raise ConfigError(
                    f"Invalid usage: input {pattern} is a directory but not a Hugging Face dataset saved "
                    f"with save_to_disk: give its files as a glob instead, e.g. '{pattern.rstrip('/')}/**/*.txt' "
                    "(quoted, so loom expands it and `**` recurses).")
            found.add(p.resolve())
            continue
        files = expand(pattern)
        if not files:
            raise ConfigError(f"Invalid usage: input {pattern!r} matches no file (a file, a glob such as "
                              "'data/**/*.jsonl.gz', or a save_to_disk directory).")
        found.update(f.resolve() for f in files)
    return sorted(found, key=str)


def input_kind(path: Path) -> tuple[str, str]:
    """(kind, format): "hf_dir", "lines" (fmt jsonl|csv), "parquet" or "text" (one document
    per file: any other suffix), looking past a .gz / .zst suffix."""
    if path.is_dir():
        return "hf_dir", ""
    name = path.name
    for c in (".gz", ".zst"):
        if name.endswith(c):
            name = name[: -len(c)]
    return FORMATS.get(Path(name).suffix.lower(), ("text", ""))


def _missing(path: Path, field: str, fields: list[str], what: str) -> ConfigError:
    return ConfigError(
        f"Invalid usage: --field {field}: {path} has no such {what}; its {what}s: "
        f"{', '.join(map(str, fields)) or '(none)'}. Pass --field with one of them.")


def _first_json(path: Path) -> dict | None:
    with open_binary(path) as f:
        for offset, line in _lines(f):
            if line.strip():
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ConfigError(f"Invalid usage: {path} at byte {offset} is not JSON lines "
                                      f"({e}): .json/.jsonl inputs hold one JSON object per line.") from None
                if not isinstance(rec, dict):
                    raise ConfigError(f"Invalid usage: {path} at byte {offset}: a JSON line is a "
                                      f"{type(rec).__name__}, not an object with a text field.")
                return rec
    return None


def _lines(f) -> object:
    offset = 0
    for line in f:
        yield offset, line
        offset += len(line)


def check_field(path: Path, kind: str, fmt: str, field: str) -> None:
    """Refuse an input whose first record (JSON lines), header (CSV) or schema has no `field`."""
    if kind == "lines" and fmt == "jsonl":
        rec = _first_json(path)
        if rec is not None and field not in rec:
            raise _missing(path, field, list(rec), "field")
    elif kind == "lines":
        header = csv_header(path)
        if header and field not in header:
            raise _missing(path, field, header, "column")
    elif kind == "parquet":
        names = parquet_file(path).schema_arrow.names
        if field not in names:
            raise _missing(path, field, names, "column")
    elif kind == "hf_dir":
        hf_dir_rows(path, field)


def parquet_row_groups(path: Path, shard_bytes: int) -> list[tuple[int, int, int]]:
    """Consecutive row groups grouped up to about `shard_bytes` of data: (first, stop, bytes)."""
    meta = parquet_file(path).metadata
    out, first, total = [], 0, 0
    for i in range(meta.num_row_groups):
        size = meta.row_group(i).total_byte_size
        if i > first and total + size > shard_bytes:
            out.append((first, i, total))
            first, total = i, 0
        total += size
    if meta.num_row_groups > first:
        out.append((first, meta.num_row_groups, total))
    return out


def hf_split(path: Path) -> tuple[Path, str]:
    """The Dataset directory of a save_to_disk dir: itself, or a DatasetDict's "train" split
    (or its only split); refused when several splits leave it ambiguous."""
    dd = path / "dataset_dict.json"
    if not dd.is_file():
        return path, ""
    splits = list(json.loads(dd.read_text()).get("splits", []))
    if "train" in splits or len(splits) == 1:
        split = "train" if "train" in splits else splits[0]
        return path / split, split
    raise ConfigError(f"Invalid usage: {path} is a DatasetDict with splits {', '.join(splits)} and no "
                      f"'train': give the split's own directory, e.g. {path / splits[0]}.")


def hf_dir_rows(path: Path, field: str) -> tuple[str, int]:
    """(the split used, its number of rows) of a save_to_disk dir, checking its columns."""
    import pyarrow as pa

    d, split = hf_split(path)
    state = json.loads((d / "state.json").read_text())
    rows, cols = 0, None
    for f in state.get("_data_files", []):
        with pa.memory_map(str(d / f["filename"])) as src:
            table = pa.ipc.open_stream(src).read_all()  # mapped, not copied
            rows += table.num_rows
            cols = cols or table.schema.names
    if cols is not None and field not in cols:
        raise _missing(path, field, cols, "column")
    return split, rows


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _inside(cuts: list[int], end: int) -> list[int]:
    """The cuts without one at the very end (it would start an empty unit)."""
    return cuts[:-1] if cuts and cuts[-1] >= end else cuts


def _cuts(f: BinaryIO, shard_bytes: int, quoted: bool) -> tuple[list[int], int]:
    """(line starts about every `shard_bytes`, the stream's length) in one sequential pass, which
    is all a compressed stream allows. CSV (`quoted`): only where the count of `"` so far is even,
    i.e. outside a quoted field (a field may hold newlines; an escaped quote `""` keeps the parity)."""
    cuts: list[int] = []
    pos, parity, target = 0, 0, shard_bytes
    while True:
        while pos < target - 1:  # jump to just before the target, counting quotes in bulk
            block = f.read(min(target - 1 - pos, 1 << 24))
            if not block:
                return _inside(cuts, pos), pos
            parity ^= block.count(b'"') & 1 if quoted else 0
            pos += len(block)
        line = f.readline()
        if not line:
            return _inside(cuts, pos), pos
        parity ^= line.count(b'"') & 1 if quoted else 0
        pos += len(line)
        if parity == 0 and line.endswith(b"\n"):
            cuts.append(pos)
            target = pos + shard_bytes


def line_cuts(path: Path, shard_bytes: int, quoted: bool) -> tuple[list[int], int]:
    """(offsets where a JSON-lines or CSV file is cut, about every `shard_bytes` of its text; the
    text's length). A compressed file is decompressed once here and the offsets are in its text:
    a unit's reader decompresses from the start and drops what precedes its range. Decompressing
    runs at hundreds of MB/s against a tokenizer's 1-2 MB/s per core, so that costs a few percent
    and lets a few big .gz/.zst files keep every worker busy (each was one unit)."""
    with open_binary(path) as f:
        return _cuts(f, shard_bytes, quoted)
