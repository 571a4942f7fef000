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


def peak_gb() -> float:
    """The process's peak RSS so far (a list built and freed in between counts: it is what a rank needs)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


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
    """Rank 3 of 8: the first training batch, then the first validation batch as the datamodule
    deals it (trainer.limit_val_batches global batches of the held-out windows: no per-window list)."""
    import torch  # noqa: F401  (the baseline includes torch, as a rank's does)
    from torch.utils.data import DataLoader

    from loom.data.batch import collate
    from loom.data.module import LoomDataModule
    from loom.data.options.tokens import datasets
    from loom.data.sampler import ResumableDistributedSampler
    from loom.data.store import read_sidecar
    from loom.pipeline import resolve

    vocab = int((read_sidecar(store) or {}).get("vocab_size") or 256)  # a real store's vocabulary, not 256
    base, peak0, t0 = rss_gb(), peak_gb(), time.perf_counter()
    cfg = resolve(["dataset=tokens", f"dataset.mix=[{store}]", f"dataset.seq_len={seq_len}",
                   "dataset.batch_size=8", "model=gpt_tiny", f"model.block_size={seq_len}",
                   f"model.vocab_size={vocab}", "hardware.dataloader_workers=0", "trainer.global_batch_size=64"])
    train, val = datasets(cfg)
    sampler = ResumableDistributedSampler(train, 8, 3, micro_batch=8, global_batch=64, seed=0)
    x, y = next(iter(DataLoader(train, batch_size=8, sampler=sampler, collate_fn=collate)))
    out = {"windows": len(train), "seconds": time.perf_counter() - t0, "rss_gb": rss_gb() - base,
           "peak_rss_gb": peak_gb() - peak0, "batch": list(x.shape), "vocab_size": vocab}
    if val is not None:
        t1 = time.perf_counter()
        dm = LoomDataModule(cfg, 3, 8)
        dm.val_set = val
        vx, _ = next(iter(dm.val_dataloader()))
        out.update(val_windows=len(val), val_evaluated=dm.val_windows(len(val)), val_seconds=time.perf_counter() - t1,
                   val_rss_gb=rss_gb() - base, val_peak_rss_gb=peak_gb() - peak0, val_batch=list(vx.shape))
    return out


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
