"""One way to write a file that readers never see half-written: a temporary sibling, then a
rename. The temporary name is unique per writer (several nodes of one run may write the same
file on shared storage at once; the last rename wins, and each rename is whole)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()


def atomic_write_text(path: Path | str, text: str, mode: int | None = None) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
        if mode is not None:
            tmp.chmod(mode)
    return Path(path)


def atomic_symlink(target: str, link: Path) -> None:
    """Point `link` at `target` (relative) in one rename."""
    with atomic_path(link) as tmp:
        os.symlink(target, tmp)
