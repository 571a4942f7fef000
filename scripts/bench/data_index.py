#!/usr/bin/env python
"""The index side of scripts/bench/data.py: one process opens a `dataset=tokens` run's data
the way a rank does (compose, the mixture of stores, the sampler, a DataLoader) and reports
the seconds and the RSS above the process's own baseline until the first batch.

    python data_index.py --store DIR [--seq-len 2048] [--cold] [--legacy N]

`--cold` drops the store's index pages from the page cache first (posix_fadvise DONTNEED);
`--legacy N`: instead, what the list-per-sample design held for N windows (a
`torch.randperm(N).tolist()` and a train-window list), for the before/after comparison.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def drop_cache(store: Path) -> None:
    for f in store.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def legacy(n: int) -> dict:
    import torch

    base, t0 = rss_gb(), time.perf_counter()
    order = torch.randperm(n).tolist()
    train = [i for i in range(n) if i % 200 != 199]
    return {"legacy_windows": n, "seconds": time.perf_counter() - t0, "rss_gb": rss_gb() - base,
            "held": len(order) + len(train)}


def first_batch(store: Path, seq_len: int) -> dict:
    import torch  # noqa: F401  (the baseline includes torch, as a rank's does)
    from torch.utils.data import DataLoader

    from loom.data.sampler import ResumableDistributedSampler
    from loom.data.stores import datasets
    from loom.pipeline import resolve

    base, t0 = rss_gb(), time.perf_counter()
    cfg = resolve(["dataset=tokens", f"dataset.mix=[{store}]", f"dataset.seq_len={seq_len}",
                   "dataset.batch_size=8", "model=gpt_tiny", f"model.block_size={seq_len}"])
    train, _ = datasets(cfg)
    sampler = ResumableDistributedSampler(train, 8, 3, micro_batch=8, global_batch=64, seed=0)
    x, y = next(iter(DataLoader(train, batch_size=8, sampler=sampler)))
    return {"windows": len(train), "seconds": time.perf_counter() - t0, "rss_gb": rss_gb() - base,
            "batch": list(x.shape)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--legacy", type=int, default=0)
    a = ap.parse_args()
    if a.legacy:
        print(json.dumps(legacy(a.legacy)))
        return
    if a.cold:
        drop_cache(a.store)
    print(json.dumps(first_batch(a.store, a.seq_len)))


if __name__ == "__main__":
    main()
