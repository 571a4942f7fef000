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


def _stores(*sets) -> list:
    """The token stores under datasets (a mixture's sources, windows of a store), each once."""
    found: dict[int, object] = {}
    for d in sets:
        for part in getattr(d, "sources", None) or [d]:
            store = getattr(part, "store", None)
            if store is not None:
                found[id(store)] = store
    return list(found.values())


def summary_line(cfg: DictConfig, train, val, dp: int) -> str:
    """`dataset tinycode: 412 files, 1,999,848 tokens -> 15,623 train / 836 val windows of 128`."""
    ds = cfg.dataset
    vals = val if isinstance(val, list) else [] if val is None else [val]
    n_val = sum(len(v) for v in vals)
    stores = _stores(train, *vals)
    if hasattr(train, "describe"):  # conversations: what is trained, what is masked, what was cut
        size = train.describe(n_val)
    elif stores:  # token windows of stores
        total = sum(int(st.n_tokens) for st in stores)
        packing = ", documents packed apart" if ds.get("packing") == "documents" else ""
        size = (f"{total:,} tokens -> {len(train):,} train / {n_val:,} val windows of {ds.seq_len} tokens"
                f"{packing}")
    else:
        size = f"{len(train):,} train / {n_val:,} val samples"
    accumulation = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    batch = (f"{ds.batch_size * accumulation * dp} ({ds.batch_size} x {accumulation} accumulated x {dp} ranks)"
             if accumulation > 1 else f"{ds.batch_size} x {dp}")
    return f"dataset {ds.name}: {source(cfg)}, {size}; global batch {batch}"
