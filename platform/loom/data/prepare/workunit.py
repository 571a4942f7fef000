"""The unit of work: what one worker reads into one shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InputUnit:
    """One unit of work, picklable and JSON-able (it is recorded in the resume plan).

    kind: "files" (one document per file), "lines" (JSON lines or CSV rows, `fmt`), "parquet",
    "hf_dir" (a save_to_disk directory) or "hf_rows" (a dataset reloaded from `load_spec`).
    start/stop: a byte range (lines), row groups (parquet) or rows (hf); stop -1 is the end."""

    kind: str
    paths: tuple[str, ...]
    fmt: str = ""
    field: str = ""
    start: int = 0
    stop: int = -1
    bytes: int = 0
    load_spec: dict[str, Any] | None = None
    val_every: int = 0
    want_val: bool = False
    max_docs: int | None = None
    split: str = ""
