"""`dataset=synthetic`: random tokens or tensors of a configured shape, for throughput runs.

No I/O and O(1) memory: item i is drawn from its own generator seeded by (seed, split, i),
so every rank, every run and every resume sees the same item i. Tensor items get a label
that depends on the input (the argmax of its first `num_classes` values), so a classifier
can learn it; token items are uniform (the loss stays near ln(vocab)).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.data.batch import Batch
from loom.data.options.synthetic import val_samples


class SyntheticTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int, split: int = 0) -> None:
        self.n, self.seq_len, self.vocab, self.seed, self.split = n, seq_len, vocab_size, seed, split

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        rng = np.random.default_rng([self.seed, self.split, i])
        chunk = torch.from_numpy(rng.integers(0, self.vocab, self.seq_len + 1, dtype=np.int64))
        return Batch(chunk[:-1], chunk[1:])


class SyntheticTensors(Dataset):
    def __init__(self, n: int, shape: list[int], num_classes: int, seed: int, split: int = 0) -> None:
        self.n, self.shape, self.classes, self.seed, self.split = n, tuple(shape), num_classes, seed, split
        self.numel = math.prod(self.shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        rng = np.random.default_rng([self.seed, self.split, i])
        x = rng.standard_normal(self.numel, dtype=np.float32)
        y = int(np.argmax(x[: min(self.classes, self.numel)]))
        return Batch(torch.from_numpy(x.reshape(self.shape)), torch.tensor(y, dtype=torch.int64))


def datasets(cfg) -> tuple[Dataset, Dataset | None]:
    ds, seed = cfg.dataset, cfg.seed
    n_val = val_samples(ds)
    if ds.kind == "tokens":
        return (SyntheticTokens(ds.num_samples, ds.seq_len, ds.vocab_size, seed, 0),
                SyntheticTokens(n_val, ds.seq_len, ds.vocab_size, seed, 1))
    return (SyntheticTensors(ds.num_samples, list(ds.shape), ds.num_classes, seed, 0),
            SyntheticTensors(n_val, list(ds.shape), ds.num_classes, seed, 1))
