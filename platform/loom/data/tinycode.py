"""The default corpus: the Python standard library's .py sources (present wherever Python is).

No torch here: the launcher can list and size the corpus during validation.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(max_bytes: int) -> list[Path]:
    """A fixed, sorted list of stdlib .py files, truncated at `max_bytes` in that order."""
    root = stdlib_dir()
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > max_bytes and out:
            break
        out.append(p)
        total += size
    return out


def split(files: list[Path], val_every: int) -> tuple[list[Path], list[Path]]:
    """Every `val_every`-th file is validation: deterministic and spread over the corpus."""
    if val_every <= 1:
        return files, []
    train = [f for i, f in enumerate(files) if i % val_every != val_every - 1]
    val = [f for i, f in enumerate(files) if i % val_every == val_every - 1]
    return train, val
