"""What a run trains on, in one line.

Rank 0 logs the line when the datamodule is set up (so the console says, before step 1, which
files, how many tokens or samples, and how many train/val windows). No torch here.
"""

from __future__ import annotations

from omegaconf import DictConfig


def source(cfg: DictConfig) -> str:
    """Where the data comes from: files, a hub id, a path, or the generator (its registry entry)."""
    from loom.data.registry import DATASETS

    return DATASETS[cfg.dataset.name].source(cfg.dataset)


def summary_line(cfg: DictConfig, train, val, dp: int) -> str:
    """`dataset tinycode: 412 files, 1,999,848 tokens -> 15,623 train / 836 val windows of 128`."""
    ds = cfg.dataset
    n_val = len(val) if val is not None else 0
    tokens = getattr(train, "tokens", None)
    if tokens is not None:  # packed token windows
        total = len(tokens) + (len(val.tokens) if val is not None and hasattr(val, "tokens") else 0)
        size = f"{total:,} tokens -> {len(train):,} train / {n_val:,} val windows of {ds.seq_len} tokens"
    else:
        size = f"{len(train):,} train / {n_val:,} val samples"
    accumulation = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    batch = (f"{ds.batch_size * accumulation * dp} ({ds.batch_size} x {accumulation} accumulated x {dp} ranks)"
             if accumulation > 1 else f"{ds.batch_size} x {dp}")
    return f"dataset {ds.name}: {source(cfg)}, {size}; global batch {batch}"
