"""`dataset=text_files`: your own text corpus, by glob patterns (no torch here: validation
globs the patterns, so a pattern that matches nothing is refused before any process starts).
"""

from __future__ import annotations

import glob
from pathlib import Path


def expand(pattern: str) -> list[Path]:
    """The regular files one pattern matches (`~` expanded, `**` recursive), sorted."""
    p = str(Path(pattern).expanduser())
    return sorted(Path(f) for f in glob.glob(p, recursive=True) if Path(f).is_file())


def corpus_files(patterns: list[str], max_bytes: int | None = None) -> list[Path]:
    """Every file the patterns match, deduplicated, in sorted order, capped at `max_bytes`."""
    files = sorted({f.resolve() for pat in patterns for f in expand(pat)}, key=str)
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
