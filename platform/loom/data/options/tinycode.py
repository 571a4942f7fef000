"""`dataset=tinycode`, the default corpus: the Python standard library's .py sources (present
wherever Python is).

No torch here: the launcher can list and size the corpus during validation.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from loom.data.checks import corpus_val_size
from loom.data.files import first_bytes
from loom.data.fingerprint import DataInputs
from loom.data.option import DatasetOption, always


@dataclass
class TinycodeDatasetConfig:
    name: str = "tinycode"
    batch_size: int = 16
    seq_len: int = 128
    packing: str = "concat"           # concat | documents (no attention across documents)
    max_bytes: int = 16_000_000
    val_every: int = 20
    tokenizer: str | None = None      # null: byte-level (vocab 256); else a local HF tokenizer
    cache_dir: str | None = None


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


_INSTALLED = frozenset({"site-packages", "dist-packages"})


@functools.cache
def stdlib_sources(root: Path) -> tuple[Path, ...]:
    """Every .py file under `root`, sorted by relative path, leaving installed packages out.
    os.walk prunes site-packages instead of walking it (rglob then filtering took about 1 s
    where torch is installed there), and the list is kept: a rank asks twice."""
    found: list[tuple[str, Path]] = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _INSTALLED]
        rel = Path(folder).relative_to(root)
        found += [((rel / n).as_posix(), Path(folder) / n) for n in names if n.endswith(".py")]
    return tuple(path for _, path in sorted(found))


def corpus_files(max_bytes: int) -> list[Path]:
    """A fixed, sorted list of stdlib .py files, truncated at `max_bytes` in that order."""
    return first_bytes(list(stdlib_sources(stdlib_dir())), max_bytes)


def inputs(ds: DictConfig) -> DataInputs:
    """The running Python's standard library: its version and path stand for its files (listing
    ~1000 files would cost the launcher a second)."""
    return DataInputs(note=f"Python {sys.version.split()[0]} standard library ({stdlib_dir()})")


def source(ds: DictConfig) -> str:
    return f"{len(corpus_files(ds.max_bytes))} Python standard library files"


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, object]:
    """The train and val token stores, prepared into the cache where missing."""
    from loom.data.tokens import file_stores

    return file_stores(cfg.dataset, corpus_files(cfg.dataset.max_bytes), cfg.dataset.val_every, workers)


def datasets(cfg: DictConfig):
    """(train, val) token windows of the cached stores."""
    from loom.data.tokens import front_end_datasets

    return front_end_datasets(cfg, stores(cfg))


OPTION = DatasetOption(TinycodeDatasetConfig, "loom.data.options.tinycode:datasets", always(True), inputs, source,
                       tokenized=True, stores=stores,
                       val_size=lambda ds: corpus_val_size(ds, corpus_files(ds.max_bytes)))
