"""The text front ends (tinycode, text_files, hf): their documents prepared once into token
stores in the cache, then trained through the same windows and mixture as `dataset=tokens`.

A front end describes its documents as `loom data prepare` work units (loom.data.prepare) for
each split; the first run tokenizes them into `<cache>/<name>-<key>[-<tokenizer>]/<split>/`
(a store: Megatron's .bin/.idx shards and the loom.json sidecar, written last, so a store is
there whole or not at all), in parallel in the launcher before the ranks start (`prepare_stores`,
every core, progress lines), or in rank 0's `prepare_data` where the launcher did not (a
SLURM job; one worker, progress lines in the rank-0 log). A later run with the same corpus and
tokenizer opens the store without tokenizing (the key fingerprints both). No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from loom.data.cache import cache_root, fingerprint

log = logging.getLogger("loom")
SPLITS = ("train", "val")


def store_dir(name: str, key: str, ds: DictConfig, split: str) -> Path:
    """Where a front end's split is cached: keyed by its corpus and its tokenizer."""
    from loom.data.prepare import tokenizer_fingerprint

    tok = ds.get("tokenizer")
    tkey = f"-{tokenizer_fingerprint(str(tok))[:12]}" if tok else ""
    return cache_root(ds.get("cache_dir")) / f"{name}-{key}{tkey}" / split


def cached_store(out: Path, units: Callable[[], list], tokenizer: str | None, workers: int | None = 1):
    """The store at `out`, prepared from `units()` first when it is not there whole."""
    from loom.data.store import SIDECAR, open_store

    if not (out / SIDECAR).is_file():
        work = units()
        if not work:
            return None
        from loom.data.prepare import prepare

        log.info(f"dataset: tokenizing {len(work)} unit(s) into {out} (once; later runs reuse it)")
        prepare(work, out, tokenizer, workers=workers, progress="lines", log=log.info)
    return open_store(out)


def split_stores(name: str, key: str, ds: DictConfig, units: dict[str, Callable[[], list]],
                 workers: int | None = 1) -> dict[str, object]:
    """{split: store or None (no documents)} of a front end, prepared where missing."""
    return {split: cached_store(store_dir(name, key, ds, split), make, ds.get("tokenizer"), workers)
            for split, make in units.items()}


def front_end_datasets(cfg: DictConfig, stores: dict[str, object], val_every_window: int | None = None):
    """(train, val) of a front end's stores, through dataset=tokens' mixture (one source): the
    same windows, seeded epochs and document packing. `val_every_window` = k: one store whose
    every k-th window is validation (a corpus of fewer files than val_every)."""
    from loom.data.mix import Mixture, SourceWindows

    ds = cfg.dataset
    kw = {"documents": ds.get("packing") == "documents"}
    train_store = stores["train"]
    if train_store is None:
        raise ValueError(f"dataset {ds.name}: the training split has no document")
    if val_every_window:
        fraction = 1.0 / val_every_window
        train = SourceWindows(train_store, ds.name, ds.seq_len, part="train", val_fraction=fraction, **kw)
        val = SourceWindows(train_store, ds.name, ds.seq_len, part="val", val_fraction=fraction, **kw)
    else:
        train = SourceWindows(train_store, ds.name, ds.seq_len, **kw)
        val = SourceWindows(stores["val"], ds.name, ds.seq_len, **kw) if stores.get("val") is not None else None
    if len(train) == 0:
        raise ValueError(f"dataset {ds.name}: the training split has fewer than seq_len+1={ds.seq_len + 1} tokens")
    return Mixture([train], [1], int(cfg.seed)), (val if val is not None and len(val) else None)


def file_stores(ds: DictConfig, files: list[Path], val_every: int, workers: int | None = 1) -> dict[str, object]:
    """tinycode / text_files: one document per file, every `val_every`-th file to validation."""
    from loom.data.files import split
    from loom.data.prepare import file_doc_units

    train, val = split(files, val_every)
    key = fingerprint(files, ds.max_bytes, val_every)
    return split_stores(ds.name, key, ds, {"train": lambda: file_doc_units(train),
                                           "val": lambda: file_doc_units(val)}, workers)
