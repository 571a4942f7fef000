"""A DistributedSampler that can start an epoch part-way through.

Lightning restarts an interrupted epoch from its first batch unless the loader is
stateful, which replays data after a resume. This sampler keeps DistributedSampler's
order (seeded by seed + epoch) and skips the samples this rank already consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.resume_epoch: int | None = None
        self.resume_samples = 0

    def resume_at(self, epoch: int, samples: int) -> None:
        """The next iteration over `epoch` skips its first `samples` indices (this rank's)."""
        self.resume_epoch, self.resume_samples = epoch, samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.resume_epoch == self.epoch and self.resume_samples:
            indices = indices[self.resume_samples :]
            self.resume_epoch, self.resume_samples = None, 0
        return iter(indices)
