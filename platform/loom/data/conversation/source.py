"""What the rendering options share around the template: the source's rows in order, and a cache
entry written whole (rendered beside it, renamed into place; a refused or interrupted render leaves
nothing in the cache). No torch here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from omegaconf import DictConfig


def rows(ds: DictConfig) -> Iterator[tuple[int, dict]]:
    """(index, row) of the configured source, at most `dataset.max_docs` of them."""
    from loom.data.prepare.hf_source import load

    dataset = load(ds)  # a file it cannot read: ConfigError naming the file, the row and the error
    i = 0
    for batch in dataset.iter(batch_size=256):
        keys = list(batch)
        for j in range(len(batch[keys[0]]) if keys else 0):
            if ds.get("max_docs") is not None and i >= ds.max_docs:
                return
            yield i, {k: batch[k][j] for k in keys}
            i += 1


def write_whole(root: Path, complete: Callable[[Path], bool], render: Callable[[Path], None]) -> None:
    """`render(dir)` into a directory beside `root`, renamed to it when whole; a failure removes it."""
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        render(tmp)
        if root.exists() and not complete(root):  # left by an older Loom's interrupted render
            shutil.rmtree(root, ignore_errors=True)
        if not root.exists():  # else another process finished the same entry first
            os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
