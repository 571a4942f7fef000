"""What a run's data *is*, beyond its config: a fingerprint of the files a dataset reads.

The run id and the resume check (`loom.freeze`) include it, so editing, adding or removing a
corpus file starts a new run (auto run id) or is refused on resume (explicit run.id), instead
of resuming with different data. Each dataset option declares what it reads in its registry
entry (`DatasetOption.inputs`, required: a new file-based dataset cannot forget it); this module
turns that into one line. File list, sizes and modification times (as the token cache's own
key, `loom.data.tokens.fingerprint`); no file is read. No torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig


@dataclass(frozen=True)
class DataInputs:
    """What of a dataset lies outside its config: the files it reads, and a note standing for
    files too many to list (tinycode: the standard library's version and path)."""

    files: list[Path] = field(default_factory=list)
    note: str | None = None


def no_inputs(ds: DictConfig) -> DataInputs:
    """Data fixed by its config alone (synthetic, digits) or by a hub name the library's cache
    fingerprints itself."""
    return DataInputs()


def _tokenizer_files(ds: DictConfig) -> list[Path]:
    tok = Path(str(ds.get("tokenizer") or "")).expanduser()
    return sorted(f for f in tok.rglob("*") if f.is_file()) if ds.get("tokenizer") and tok.is_dir() else []


def _digest(files: list[Path]) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def fingerprint_line(inputs: DataInputs, ds: DictConfig) -> str | None:
    """One line naming the data's files and their digest, and the tokenizer's (every dataset
    option with a `tokenizer` key shares this); None when there is nothing outside the config."""
    parts = [inputs.note] if inputs.note else []
    if inputs.files:
        size = sum(f.stat().st_size for f in inputs.files)
        parts.append(f"{len(inputs.files)} files, {size:,} bytes, digest {_digest(inputs.files)}")
    tok = _tokenizer_files(ds)
    if tok:
        parts.append(f"tokenizer {len(tok)} files, digest {_digest(tok)}")
    return "; ".join(parts) or None
