"""`dataset=text_files`: your own text corpus, by glob patterns (no torch here: validation
globs the patterns, so a pattern that matches nothing is refused before any process starts).
"""

from __future__ import annotations

import glob
from pathlib import Path

from omegaconf import DictConfig

from loom.data.files import first_bytes
from loom.data.fingerprint import DataInputs


def expand(pattern: str) -> list[Path]:
    """The regular files one pattern matches (`~` expanded, `**` recursive), sorted."""
    p = str(Path(pattern).expanduser())
    return sorted(Path(f) for f in glob.glob(p, recursive=True) if Path(f).is_file())


def corpus_files(patterns: list[str], max_bytes: int | None = None) -> list[Path]:
    """Every file the patterns match, deduplicated, in sorted order, capped at `max_bytes`."""
    files = sorted({f.resolve() for pat in patterns for f in expand(pat)}, key=str)
    return first_bytes(files, max_bytes)


def inputs(ds: DictConfig) -> DataInputs:
    return DataInputs(files=corpus_files(list(ds.paths), ds.max_bytes))


def source(ds: DictConfig) -> str:
    return f"{len(corpus_files(list(ds.paths), ds.max_bytes))} file(s) from {', '.join(map(str, ds.paths))}"


def window_split_every(ds: DictConfig, n_files: int) -> int | None:
    """k when validation is every k-th window (fewer files than val_every), else None."""
    if ds.name != "text_files" or ds.val_every <= 1 or n_files >= ds.val_every:
        return None
    fraction = ds.get("val_fraction") or 1.0 / ds.val_every
    return max(2, round(1.0 / fraction))


def datasets(cfg: DictConfig):
    """(train, val) token windows, tokenized into the cache on first use. Validation is every
    `val_every`-th file; a corpus of fewer files than that (a few big books) would get none, so
    then it is every k-th window of all files instead (k = round(1 / val_fraction))."""
    from loom.data.tokens import file_token_datasets, split_windows

    ds = cfg.dataset
    files = corpus_files(list(ds.paths), ds.max_bytes)
    k = window_split_every(ds, len(files))
    if k is None:
        return file_token_datasets(ds, files)
    whole, _ = file_token_datasets(ds, files, val_every=0)
    return split_windows(whole, 1.0 / k)
