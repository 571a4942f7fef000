"""Corpus files shared by the file-based datasets (tinycode, text_files): the byte cap and the
train/validation split. No torch: validation sizes the corpus before any process starts."""

from __future__ import annotations

import glob
from pathlib import Path


def expand(pattern: str) -> list[Path]:
    """The regular files one pattern matches (`~` expanded, `**` recursive), sorted."""
    p = str(Path(pattern).expanduser())
    return sorted(Path(f) for f in glob.glob(p, recursive=True) if Path(f).is_file())


def first_bytes(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The leading files of `files` whose sizes add up to at most `max_bytes` (at least one)."""
    if max_bytes is None:
        return files
    out, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > max_bytes and out:
            break
        out.append(f)
        total += size
    return out


def split(files: list[Path], val_every: int) -> tuple[list[Path], list[Path]]:
    """Every `val_every`-th file is validation: deterministic and spread over the corpus."""
    if val_every <= 1:
        return files, []
    train = [f for i, f in enumerate(files) if i % val_every != val_every - 1]
    val = [f for i, f in enumerate(files) if i % val_every == val_every - 1]
    return train, val
