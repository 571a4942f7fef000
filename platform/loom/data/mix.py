"""The token datasets every text option trains through: windows of one token store
(`SourceWindows`) and a seeded, weighted, seekable mixture of them (`Mixture`).

Nothing here is a list per sample: window t of a source is arithmetic on the store's stream
(loom.data.index.windows), each source's epoch is shuffled by a seekable permutation, and a
mixture's sample k is found from its blend schedule (loom.data.index.blend). Memory is the
stores' memory maps and a few small arrays, whatever the corpus size.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.data.batch import Batch
from loom.data.index import Blend, Holdout, Permutation
from loom.data.index.feistel import seed_key
from loom.data.index.windows import IGNORE, window_positions, windows_of


class SourceWindows(Dataset):
    """The train or validation windows of one store. `vocab_limit`: a token id at or above it
    stops the run naming the store and document (a store written with another tokenizer),
    instead of an index error deep in the embedding."""

    def __init__(self, store, name: str, seq_len: int, *, part: str = "all", val_fraction: float | None = None,
                 documents: bool = False, vocab_limit: int | None = None) -> None:
        self.store, self.name, self.seq_len = store, name, int(seq_len)
        self.holdout = Holdout.of(windows_of(store.n_tokens, seq_len), val_fraction if part != "all" else None)
        self.part, self.documents, self.vocab_limit = part, documents, vocab_limit
        self.n = {"all": self.holdout.windows, "train": self.holdout.n_train, "val": self.holdout.n_val}[part]

    def __len__(self) -> int:
        return self.n

    def window(self, i: int) -> int:
        """The stream window of this part's sample i."""
        return self.holdout.val_window(i) if self.part == "val" else self.holdout.train_window(i)

    def _check_ids(self, chunk: np.ndarray, start: int) -> None:
        top = int(chunk.max())
        if self.vocab_limit is not None and top >= self.vocab_limit:
            at = start + int(np.argmax(chunk >= self.vocab_limit))
            raise ValueError(
                f"dataset source {self.name!r} ({self.store.path}): token id {top} in document "
                f"{self.store.doc_at(at)} (token {at:,}) is outside the model's vocabulary of {self.vocab_limit}: "
                "the store was written with another tokenizer. Prepare it with the run's tokenizer "
                "(`loom data prepare ... --tokenizer`), or set model.vocab_size to cover it.")

    def prefetch(self, i: int) -> None:
        """Sample i will be read soon: a remote store fetches its chunks ahead (a local one: nothing)."""
        self.store.prefetch(self.window(int(i)) * self.seq_len, self.seq_len + 1)

    def __getitem__(self, i: int) -> Batch:
        start = self.window(int(i)) * self.seq_len
        chunk = self.store.read(start, self.seq_len + 1).astype(np.int64)
        self._check_ids(chunk, start)
        x, y = chunk[:-1], chunk[1:].copy()
        if not self.documents:
            return Batch(torch.from_numpy(x), torch.from_numpy(y))
        starts = self.store.doc_starts(start, start + self.seq_len + 1) - start
        positions, crossing = window_positions(np.asarray(starts, dtype=np.int64), self.seq_len)
        y[crossing] = IGNORE
        return Batch(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(positions), masked=True)


class Mixture(Dataset):
    """Sources drawn by weight, each source's windows in a fresh seeded order every time it is
    read through (its epochs counted): index k of the mixture is the blend's sample k, so the
    sampler reads it in order (`ordered`), epoch e continuing at k = e * len(self). One epoch
    of the mixture is as many samples as its sources hold together."""

    ordered = True

    def __init__(self, sources: list[SourceWindows], weights: list, seed: int, prefetch_ahead: int = 0) -> None:
        empty = [s.name for s in sources if len(s) == 0]
        if empty:
            raise ValueError(f"dataset sources {empty} have no training window of seq_len+1 tokens")
        self.sources, self.weights, self.seed = sources, list(weights), int(seed)
        self.blend = Blend(self.weights)
        self._perms: dict[tuple[int, int], Permutation] = {}
        # micro batches whose chunks the sampler fetches ahead (a source in object storage; else none)
        self.prefetch_ahead = int(prefetch_ahead) if self.remote else 0

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def remote(self) -> bool:
        """Whether a source lives in object storage (its path a URL, not a local Path)."""
        return any(isinstance(s.store.path, str) for s in self.sources)

    def locate(self, k: int) -> tuple[int, int, int]:
        """(source, its epoch, its window) of mixture sample k."""
        j, m = self.blend.source_of(k)
        n = len(self.sources[j])
        epoch, r = divmod(m, n)
        key = (j, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = Permutation(n, seed_key(self.seed, j, epoch))
        return j, epoch, self._perms[key](r)

    def __getitem__(self, k: int) -> Batch:
        j, _, t = self.locate(int(k))
        return self.sources[j][t]

    def prefetch(self, k: int) -> None:
        j, _, t = self.locate(int(k))
        self.sources[j].prefetch(t)

    def consumed(self, samples: int) -> dict[str, dict]:
        """Per source, what the first `samples` samples of the mixture drew from it."""
        out = {}
        for src, w, c in zip(self.sources, self.weights, self.blend.counts(samples), strict=True):
            out[src.name] = {"weight": float(w), "samples": c, "tokens": c * src.seq_len,
                             "epochs": round(c / max(1, len(src)), 4)}
        return out
