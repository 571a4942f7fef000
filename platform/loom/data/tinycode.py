"""The default corpus: the Python standard library's .py sources (present wherever Python is).

No torch here: the launcher can list and size the corpus during validation.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from omegaconf import DictConfig

from loom.data.files import first_bytes


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(max_bytes: int) -> list[Path]:
    """A fixed, sorted list of stdlib .py files, truncated at `max_bytes` in that order."""
    root = stdlib_dir()
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return first_bytes(files, max_bytes)


def datasets(cfg: DictConfig):
    """(train, val) token windows, tokenized into the cache on first use."""
    from loom.data.tokens import file_token_datasets

    return file_token_datasets(cfg.dataset, corpus_files(cfg.dataset.max_bytes))
