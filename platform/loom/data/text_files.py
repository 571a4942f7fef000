"""`dataset=text_files`: your own text corpus, by glob patterns (no torch here: validation
globs the patterns, so a pattern that matches nothing is refused before any process starts).
"""

from __future__ import annotations

import glob
from pathlib import Path

from omegaconf import DictConfig

from loom.data.files import first_bytes


def expand(pattern: str) -> list[Path]:
    """The regular files one pattern matches (`~` expanded, `**` recursive), sorted."""
    p = str(Path(pattern).expanduser())
    return sorted(Path(f) for f in glob.glob(p, recursive=True) if Path(f).is_file())


def corpus_files(patterns: list[str], max_bytes: int | None = None) -> list[Path]:
    """Every file the patterns match, deduplicated, in sorted order, capped at `max_bytes`."""
    files = sorted({f.resolve() for pat in patterns for f in expand(pat)}, key=str)
    return first_bytes(files, max_bytes)


def datasets(cfg: DictConfig):
    """(train, val) token windows, tokenized into the cache on first use."""
    from loom.data.tokens import file_token_datasets

    ds = cfg.dataset
    return file_token_datasets(ds, corpus_files(list(ds.paths), ds.max_bytes))
