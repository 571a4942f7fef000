"""What a run's data *is*, beyond its config: a fingerprint of the files a dataset reads.

The run id and the resume check (`loom.freeze`) include it, so editing, adding or removing a
corpus file starts a new run (auto run id) or is refused on resume (explicit run.id), instead
of resuming with different data. File list, sizes and modification times (as the token cache's
own key, `loom.data.tokens.fingerprint`); no file is read. No torch.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from omegaconf import DictConfig


def _hf_files(ds: DictConfig) -> list[Path] | None:
    """A local source's files; None for a hub dataset (the library's cache fingerprints it)."""
    if not ds.path:
        return None
    from loom.data import hf

    p = Path(ds.path).expanduser()
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else hf.data_files(ds.path)


def dataset_files(cfg: DictConfig) -> list[Path] | None:
    """The files the configured dataset reads (None: not file-based, or fixed by its name)."""
    ds = cfg.dataset
    if ds.name == "text_files":
        from loom.data.text_files import corpus_files

        return corpus_files(list(ds.paths), ds.max_bytes)
    if ds.name == "hf":
        return _hf_files(ds)
    return None


def _tokenizer_files(ds: DictConfig) -> list[Path]:
    tok = Path(str(ds.get("tokenizer") or "")).expanduser()
    return sorted(f for f in tok.rglob("*") if f.is_file()) if ds.get("tokenizer") and tok.is_dir() else []


def _digest(files: list[Path]) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def dataset_fingerprint(cfg: DictConfig) -> str | None:
    """One line naming the data's files and their digest; None when there are no files to
    fingerprint (synthetic, digits, a hub dataset). tinycode is the running Python's standard
    library: its version and path stand for it (listing ~1000 files would cost a second)."""
    ds = cfg.dataset
    parts = []
    if ds.name == "tinycode":
        from loom.data.tinycode import stdlib_dir

        parts.append(f"Python {sys.version.split()[0]} standard library ({stdlib_dir()})")
    files = dataset_files(cfg)
    if files is not None:
        size = sum(f.stat().st_size for f in files)
        parts.append(f"{len(files)} files, {size:,} bytes, digest {_digest(files)}")
    tok = _tokenizer_files(ds)
    if tok:
        parts.append(f"tokenizer {len(tok)} files, digest {_digest(tok)}")
    return "; ".join(parts) or None
