"""One source's samples: seq_len+1-token windows of its token stream, the validation holdout,
and, for `dataset.packing=documents`, each window's document positions. Arithmetic only.

Window w covers tokens [w*L, w*L + L + 1) of the stream (inputs and next-token targets,
non-overlapping, as Megatron and nanoGPT cut them). With a holdout of every k-th window
(k = round(1 / val_fraction)), train window t is window t + t // (k - 1) and validation window
v is window v*k + k - 1: spread over the whole store, nothing listed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom.data.batch import IGNORE_INDEX

IGNORE = IGNORE_INDEX  # a target the loss skips (loom.data.batch owns the value)


def windows_of(n_tokens: int, seq_len: int) -> int:
    return max(0, (int(n_tokens) - 1) // int(seq_len))


@dataclass(frozen=True)
class Holdout:
    """Every k-th window of a source to validation (k = 0: none)."""

    windows: int
    k: int

    @classmethod
    def of(cls, windows: int, val_fraction: float | None) -> Holdout:
        k = max(2, round(1.0 / val_fraction)) if val_fraction else 0
        return cls(int(windows), k)

    @property
    def n_val(self) -> int:
        return self.windows // self.k if self.k else 0

    @property
    def n_train(self) -> int:
        return self.windows - self.n_val

    def train_window(self, t: int) -> int:
        return t + t // (self.k - 1) if self.k else t

    def val_window(self, v: int) -> int:
        return v * self.k + self.k - 1


def window_positions(starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, crossing) for a window of `length` inputs whose documents start at the local
    offsets `starts` (0 < s <= length; s == length: the last target opens a new document).
    positions[i]: token i's place in its document, from 0 at each start (and at the window's
    first token); crossing[i]: the target of input i is another document's first token."""
    idx = np.arange(length, dtype=np.int64)
    mark = np.zeros(length, dtype=np.int64)
    inside = starts[starts < length]
    mark[inside] = inside
    positions = idx - np.maximum.accumulate(mark)
    crossing = np.zeros(length, dtype=bool)
    crossing[starts - 1] = True
    return positions, crossing
