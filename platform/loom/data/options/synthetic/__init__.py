"""`dataset=synthetic`: random tokens or tensors of a configured shape, for throughput runs.
The torch half (`sets.py`) draws the items; this half (schema, checks, sizes) is torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from loom.data.fingerprint import no_inputs
from loom.data.option import DatasetOption
from loom.errors import fail
from loom.layout import ParallelLayout

KINDS = ("tokens", "tensors")


@dataclass
class SyntheticDatasetConfig:
    name: str = "synthetic"
    batch_size: int = 16
    kind: str = "tokens"              # tokens | tensors
    seq_len: int = 128                # tokens
    vocab_size: int = 256             # tokens
    shape: list[int] = field(default_factory=lambda: [64])  # tensors: one sample's shape
    num_classes: int = 10             # tensors
    num_samples: int = 8192


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    ds = cfg.dataset
    if ds.kind not in KINDS:
        fail("dataset.kind", ds.kind, f"valid choices: {', '.join(KINDS)}")
    if ds.kind == "tensors":
        if not ds.shape or any(int(d) < 1 for d in ds.shape):
            fail("dataset.shape", list(ds.shape), "list positive sizes, e.g. dataset.shape='[3,32,32]'")
        if ds.num_classes < 2:
            fail("dataset.num_classes", ds.num_classes, "must be >= 2")
    elif ds.vocab_size < 2:
        fail("dataset.vocab_size", ds.vocab_size, "must be >= 2")
    need = ds.batch_size * layout.dp
    if ds.num_samples < need:
        fail("dataset.num_samples", ds.num_samples,
             f"fewer than one global batch ({need} = dataset.batch_size x {layout.dp} ranks)")


def val_samples(ds: DictConfig) -> int:
    """The validation split's samples: a sixteenth of the training split's, at least one."""
    return max(1, ds.num_samples // 16)


def features(ds: DictConfig) -> tuple[int, int] | None:
    return (math.prod(ds.shape), int(ds.num_classes)) if ds.kind == "tensors" else None


OPTION = DatasetOption(SyntheticDatasetConfig, "loom.data.options.synthetic.sets:datasets",
                       lambda ds: ds.kind == "tokens", no_inputs, lambda ds: f"random {ds.kind}",
                       val_size=val_samples, features=features, check=check, vocab=lambda ds: int(ds.vocab_size))
