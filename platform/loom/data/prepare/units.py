"""Work units: the inputs cut into pieces whose boundaries depend only on the inputs and the
shard size, never on the worker count, so unit i always writes the same shard `part-{i:05d}`.

Text files are grouped in order up to about a shard of input; a JSON-lines or CSV file is cut
at record boundaries into ranges of its text (a .gz/.zst one found in one decompressing pass:
scan.line_cuts says why that is cheap), so a few big compressed files still use every worker;
parquet by row groups (a compressed parquet file is one unit); a Hugging Face dataset by row
ranges. A unit's `bytes` is its text (a parquet unit's share of the file), what progress counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.data.prepare.scan import (
    check_field,
    dir_bytes,
    hf_dir_rows,
    input_kind,
    line_cuts,
    parquet_row_groups,
    resolve_inputs,
)
from loom.data.prepare.workunit import InputUnit

COMPRESSED = (".gz", ".zst")
MAX_SHARD = 256 << 20
MIN_SHARD = 1 << 20
AUTO_UNITS = 64


def auto_shard_bytes(total_text: int) -> int:
    """The default unit size: a 64th of the input's text, within [1 MB, 256 MB], so a corpus of a
    few hundred MB still keeps every core busy. It depends on the inputs only, never on --workers."""
    return min(MAX_SHARD, max(MIN_SHARD, total_text // AUTO_UNITS))


def _pick(candidates: list[int], shard_bytes: int) -> list[int]:
    """Cuts about every `shard_bytes` out of candidate cuts found about every MIN_SHARD: the
    first candidate at or past each target (as line_cuts takes the first line start)."""
    cuts: list[int] = []
    target = shard_bytes
    for c in candidates:
        if c >= target:
            cuts.append(c)
            target = c + shard_bytes
    return cuts


def _group_files(files: list[tuple[str, int]], shard_bytes: int) -> list[InputUnit]:
    units, group, total = [], [], 0
    for path, size in files:
        if group and total + size > shard_bytes:
            units.append(InputUnit("files", tuple(group), bytes=total))
            group, total = [], 0
        group.append(path)
        total += size
    if group:
        units.append(InputUnit("files", tuple(group), bytes=total))
    return units


def file_doc_units(files: list[Path], shard_bytes: int = 256 << 20) -> list[InputUnit]:
    """One document per file, files grouped in the order given (tinycode, text_files)."""
    return _group_files([(str(f), Path(f).stat().st_size) for f in files], shard_bytes)


def hf_row_units(load_spec: dict, column: str, n_rows: int, *, val_every: int, want_val: bool,
                 max_docs: int | None, rows_per_unit: int = 20000) -> list[InputUnit]:
    """Row ranges of a `datasets` dataset that each worker reloads with loom.data.prepare.hf_source.load
    (cached on disk by `datasets`, so reloading is cheap); the split's rows are chosen by index."""
    end = n_rows if max_docs is None else min(n_rows, max_docs)
    source = str(load_spec.get("path") or f"hub:{load_spec.get('hub')}")
    return [InputUnit("hf_rows", (source,), field=column, start=a, stop=min(end, a + rows_per_unit),
                      load_spec=dict(load_spec), val_every=val_every, want_val=want_val, max_docs=max_docs)
            for a in range(0, end, rows_per_unit)]


def _ranges(stops: list[int], size: int) -> list[tuple[int, int]]:
    bounds = [0, *stops, size]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _units_of(path: Path, kind: str, fmt: str, field_: str, shard_bytes: int,
              scanned: tuple[list[int], int] | None) -> list[InputUnit]:
    """The units of one non-text input (`scanned`: a compressed file's candidate cuts and text size)."""
    p = str(path)
    if kind == "hf_dir":
        split, n_rows = hf_dir_rows(path, field_)
        size = dir_bytes(path)
        per_row = max(1, size // max(1, n_rows))
        step = max(1, shard_bytes // per_row)
        return [InputUnit("hf_dir", (p,), field=field_, start=a, stop=min(n_rows, a + step),
                          bytes=size * (min(n_rows, a + step) - a) // max(1, n_rows), split=split)
                for a in range(0, n_rows, step)]
    size = path.stat().st_size
    if kind == "parquet" and not path.name.endswith(COMPRESSED):
        groups = parquet_row_groups(path, shard_bytes)
        total = max(1, sum(b for _, _, b in groups))
        return [InputUnit("parquet", (p,), field=field_, start=a, stop=b, bytes=size * n // total)
                for a, b, n in groups] or [InputUnit("parquet", (p,), field=field_, start=0, stop=0)]
    if kind == "parquet":
        return [InputUnit("parquet", (p,), field=field_, bytes=size)]
    if size <= shard_bytes and not path.name.endswith(COMPRESSED):
        return [InputUnit("lines", (p,), fmt=fmt, field=field_, stop=-1, bytes=size)]
    if scanned is not None:
        cuts, text = _pick(scanned[0], shard_bytes), scanned[1]
    else:
        cuts, text = line_cuts(path, shard_bytes, quoted=fmt == "csv")
    if not cuts:
        return [InputUnit("lines", (p,), fmt=fmt, field=field_, stop=-1, bytes=text)]
    return [InputUnit("lines", (p,), fmt=fmt, field=field_, start=a, stop=b, bytes=b - a)
            for a, b in _ranges(cuts, text)]


def _is_compressed_lines(path: Path, kind: str) -> bool:
    return kind == "lines" and path.name.endswith(COMPRESSED)


def units_for_inputs(inputs: list[str], field: str, shard_bytes: int | None = None) -> list[InputUnit]:
    """The CLI's inputs (files, globs, save_to_disk directories), sorted, checked (each has
    `field` where it has fields; ConfigError otherwise) and cut into units of `shard_bytes` of
    text (None: auto_shard_bytes of the whole text; a compressed file's text is then measured in
    the one decompressing pass that also finds its candidate cuts)."""
    paths = [(p, *input_kind(p)) for p in resolve_inputs(inputs)]
    for path, kind, fmt in paths:
        if kind != "text":
            check_field(path, kind, fmt, field)
    scans: dict[Path, tuple[list[int], int]] = {}
    if shard_bytes is None:
        scans = {path: line_cuts(path, MIN_SHARD, quoted=fmt == "csv")
                 for path, kind, fmt in paths if _is_compressed_lines(path, kind)}
        shard_bytes = auto_shard_bytes(sum(scans[p][1] if p in scans else dir_bytes(p) if p.is_dir() else
                                           p.stat().st_size for p, _, _ in paths))
    units: list[InputUnit] = []
    pending: list[tuple[str, int]] = []
    for path, kind, fmt in paths:
        if kind == "text":
            pending.append((str(path), path.stat().st_size))
            continue
        units += _group_files(pending, shard_bytes)
        pending = []
        units += _units_of(path, kind, fmt, field, shard_bytes, scans.get(path))
    return units + _group_files(pending, shard_bytes)


def sources_of(units: list[InputUnit]) -> list[dict[str, Any]]:
    """Each input once, in order, with its size on disk (None for a dataset reloaded by spec)."""
    seen: dict[str, int | None] = {}
    for u in units:
        for p in u.paths:
            if p in seen:
                continue
            path = Path(p)
            seen[p] = (None if u.kind == "hf_rows" else
                       dir_bytes(path) if path.is_dir() else path.stat().st_size)
    return [{"path": p, "bytes": b} for p, b in seen.items()]
