"""`dataset=text_files`: your own text corpus, by glob patterns (no torch here: validation
globs the patterns, so a pattern that matches nothing is refused before any process starts).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from loom.data.files import expand, first_bytes
from loom.data.fingerprint import DataInputs


def corpus_files(patterns: list[str], max_bytes: int | None = None) -> list[Path]:
    """Every file the patterns match, deduplicated, in sorted order, capped at `max_bytes`."""
    files = sorted({f.resolve() for pat in patterns for f in expand(pat)}, key=str)
    return first_bytes(files, max_bytes)


TOKEN_SUFFIXES = (".bin", ".idx", ".npy")  # token files (nanoGPT, Megatron), never text


def binary_files(files: list[Path], sniff: int = 200) -> list[Path]:
    """Files that are not text: a token file's suffix, or a NUL byte in the first 4 KB (of the
    first `sniff` files: validation stays quick on a corpus of millions of files)."""
    found = [f for f in files if f.suffix in TOKEN_SUFFIXES]
    for f in files[:sniff]:
        if f not in found:
            with open(f, "rb") as fh:
                if b"\x00" in fh.read(4096):
                    found.append(f)
    return found


def inputs(ds: DictConfig) -> DataInputs:
    return DataInputs(files=corpus_files(list(ds.paths), ds.max_bytes))


def source(ds: DictConfig) -> str:
    return f"{len(corpus_files(list(ds.paths), ds.max_bytes))} file(s) from {', '.join(map(str, ds.paths))}"


def window_split_every(ds: DictConfig, n_files: int) -> int | None:
    """k when validation is every k-th window (fewer files than val_every), else None."""
    if ds.val_every <= 1 or n_files >= ds.val_every:
        return None
    fraction = ds.get("val_fraction") or 1.0 / ds.val_every
    return max(2, round(1.0 / fraction))


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, object]:
    """The train and val token stores (one store when validation is by window), prepared into
    the cache where missing."""
    from loom.data.tokens import file_stores

    ds = cfg.dataset
    files = corpus_files(list(ds.paths), ds.max_bytes)
    by_window = window_split_every(ds, len(files)) is not None
    return file_stores(ds, files, 0 if by_window else ds.val_every, workers)


def datasets(cfg: DictConfig):
    """(train, val) token windows. Validation is every `val_every`-th file; a corpus of fewer
    files than that (a few big books) would get none, so then it is every k-th window of all
    files instead (k = round(1 / val_fraction))."""
    from loom.data.tokens import front_end_datasets

    ds = cfg.dataset
    k = window_split_every(ds, len(corpus_files(list(ds.paths), ds.max_bytes)))
    return front_end_datasets(cfg, stores(cfg), val_every_window=k)
