"""The epoch's global sample order, dealt to data-parallel ranks by micro batch, resumable at
any position of that order and at any data-parallel size.

Written by hand rather than subclassing DistributedSampler because DistributedSampler's order
is per rank (`perm[rank::num_replicas]`): the samples rank r has consumed after k batches depend
on the number of ranks, so a run resumed with another dp size would skip or repeat samples.
Here the order is the world's: the epoch's seeded permutation (`loom.data.index.Permutation`
of seed and epoch, computed per micro batch: no list of the epoch, which at 5e7 samples held
~4 GB per rank as `torch.randperm(n).tolist()`), cut to whole global batches; micro batch k of it
(`order[k*micro:(k+1)*micro]`) goes to dp rank `k % dp`. One optimizer step is then always the
next `global_batch` samples of the order, split into micro batches however many ranks and
accumulation steps there are, so a global batch is the same set of samples at any dp, and a
position is one number: the samples of the order consumed (`resume_at`).

A dataset that orders itself (`ordered = True`: a mixture, whose schedule must hold at every
prefix) is read in its own order, epoch e continuing at index e * len(dataset).

A dataset that can fetch ahead (`prefetch(id)`: a token store in object storage) is told, as
micro batch k is handed out, the ids of this rank's micro batch `prefetch_ahead` turns later:
the sampler is the one place that knows the future order, so the storage round trips overlap the
steps in between instead of stalling them.

A dataset whose loss is a mean over the trained tokens of the global batch (`trained_tokens(ids)`:
chat data, loom.data.options.chat.samples) gets `(id, scale)` pairs instead of ids: scale is (micro
batches per step) / (trained tokens of the step's global batch), known here because a step is
always the next `global_batch` samples of the order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np
from torch.utils.data import Sampler

from loom.data.index import Permutation


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, dataset: Sized, num_replicas: int, rank: int, *, micro_batch: int,
                 global_batch: int | None = None, shuffle: bool = True, seed: int = 0,
                 prefetch_ahead: int = 0) -> None:
        self.n, self.dp, self.rank = len(dataset), int(num_replicas), int(rank)
        self.micro = int(micro_batch)
        self.global_batch = int(global_batch or self.micro * self.dp)
        if self.global_batch % (self.micro * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not a whole number of micro batches "
                             f"({self.micro}) on each of {self.dp} data-parallel ranks")
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), 0
        self.ordered = bool(getattr(dataset, "ordered", False))
        self.resume_epoch: int | None = None
        self.resume_samples = 0
        self.trained_tokens = getattr(dataset, "trained_tokens", None)
        self.prefetch = getattr(dataset, "prefetch", None) if prefetch_ahead > 0 else None
        self.ahead = int(prefetch_ahead)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_samples(self) -> int:
        """Samples of the global order one epoch trains on: whole global batches only."""
        return self.n // self.global_batch * self.global_batch

    def _ids(self, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of this epoch's global order, as sample ids."""
        pos = np.arange(start, stop, dtype=np.int64)
        if self.ordered:
            return pos + self.epoch * self.n
        return Permutation(self.n, self.seed + self.epoch)(pos) if self.shuffle else pos

    def global_order(self) -> list[int]:
        """This epoch's sample ids in the order the world consumes them (the same at any dp);
        a list, for tests and small sets: iteration computes it one micro batch at a time."""
        return self._ids(0, self.epoch_samples()).tolist()

    def resume_at(self, epoch: int, samples: int) -> None:
        """The next iteration over `epoch` starts after its first `samples` samples of the global
        order (consumed by whatever world trained them; a whole number of this world's steps)."""
        if samples % (self.micro * self.dp):
            raise ValueError(f"resume position {samples} is not a step boundary for {self.dp} ranks x "
                             f"micro batch {self.micro}")
        self.resume_epoch, self.resume_samples = int(epoch), int(samples)

    def __len__(self) -> int:
        """This rank's share of a whole epoch (Lightning counts the epoch's batches from it)."""
        return self.epoch_samples() // (self.micro * self.dp) * self.micro

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self.resume_epoch == self.epoch and self.resume_samples:
            start = self.resume_samples // self.micro
            self.resume_epoch, self.resume_samples = None, 0
        end = self.epoch_samples() // self.micro
        if self.prefetch is not None:  # the first micro batches' chunks, before the loop asks for them
            for k in range(start + self.rank, min(end, start + self.rank + self.ahead * self.dp), self.dp):
                self._prefetch(k)
        for k in range(start + self.rank, end, self.dp):
            if self.prefetch is not None and k + self.ahead * self.dp < end:
                self._prefetch(k + self.ahead * self.dp)
            ids = self._ids(k * self.micro, (k + 1) * self.micro).tolist()
            if self.trained_tokens is None:
                yield from ids
            else:
                scale = self.step_scale(k * self.micro // self.global_batch)
                yield from ((i, scale) for i in ids)

    def _prefetch(self, k: int) -> None:
        for i in self._ids(k * self.micro, (k + 1) * self.micro).tolist():
            self.prefetch(i)

    def step_scale(self, step: int) -> float:
        """(micro batches per step) / (trained tokens of this epoch's global batch `step`); 0 when
        the global batch trains no token (its loss is then 0, not NaN)."""
        lo = step * self.global_batch
        trained = int(self.trained_tokens(self._ids(lo, lo + self.global_batch)).sum())
        return self.global_batch / self.micro / trained if trained else 0.0
