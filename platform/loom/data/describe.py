"""What a run trains on, in one line, and whether its validation split can validate anything.

Rank 0 logs the line when the datamodule is set up (so the console says, before step 1, which
files, how many tokens or samples, and how many train/val windows); the launcher's checks use
`val_problem` to refuse periodic validation over a split that yields no batch. No torch here.
"""

from __future__ import annotations

from omegaconf import DictConfig


def source(cfg: DictConfig) -> str:
    """Where the data comes from: files, a hub id, a path, or the generator."""
    ds = cfg.dataset
    if ds.name == "text_files":
        from loom.data.text_files import corpus_files

        return f"{len(corpus_files(list(ds.paths), ds.max_bytes))} file(s) from {', '.join(map(str, ds.paths))}"
    if ds.name == "tinycode":
        from loom.data.tinycode import corpus_files

        return f"{len(corpus_files(ds.max_bytes))} Python standard library files"
    if ds.name == "hf":
        return f"hub {ds.hub} ({ds.config or 'default'}, {ds.split})" if ds.hub else f"{ds.path}"
    if ds.name == "digits":
        return "scikit-learn's 8x8 digits"
    if ds.name == "synthetic":
        return f"random {ds.kind}"
    return ds.name


def val_problem(cfg: DictConfig, n_val: int, dp: int) -> str | None:
    """Why a validation split of `n_val` samples/windows validates nothing (None: it is fine).
    The val loader drops a rank's last partial batch, so fewer than one batch per data-parallel
    rank is as good as empty."""
    ds = cfg.dataset
    if n_val == 0:
        every = ds.get("val_every", 2)
        how = (f"dataset.val_every={every} puts none of the data in it" if every > 1
               else f"dataset.val_every={every} turns it off")
        return f"dataset={ds.name}: the validation split is empty ({how})"
    if n_val // dp < ds.batch_size:
        return (f"dataset={ds.name}: the validation split has {n_val} sample(s)/window(s), fewer than one "
                f"batch per data-parallel rank (dataset.batch_size={ds.batch_size} x {dp} ranks): "
                "validation would not run")
    return None


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
