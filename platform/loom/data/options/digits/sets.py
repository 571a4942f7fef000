"""`dataset=digits`'s torch half: scikit-learn's bundled handwritten digits as datasets.

Shipped inside the scikit-learn wheel: no download. Features are scaled to [0, 1]; every
`val_every`-th sample is validation (deterministic).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.data.batch import Batch


class ArrayDataset(Dataset):
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        self.y = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Batch:
        return Batch(self.x[i], self.y[i])


def split_indices(n: int, val_every: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(n)
    if val_every <= 1:
        return idx, idx[:0]
    is_val = idx % val_every == val_every - 1
    return idx[~is_val], idx[is_val]


def datasets(cfg) -> tuple[ArrayDataset, ArrayDataset | None]:
    from sklearn.datasets import load_digits

    val_every = cfg.dataset.val_every
    d = load_digits()
    x, y = d.data / 16.0, d.target
    train, val = split_indices(len(y), val_every)
    return ArrayDataset(x[train], y[train]), (ArrayDataset(x[val], y[val]) if len(val) else None)
