"""One LightningDataModule for every dataset option, sharded by data-parallel rank.

The dataset options differ only in how they produce a (train, val) pair of map-style
datasets; sampling is the same for all: `ResumableDistributedSampler` (one seeded global order per
epoch, dealt to data-parallel ranks by micro batch, so a step is the same samples at any dp;
`loom.data.position.DataPosition` keeps the position in that order in every checkpoint).

Every option's samples are `loom.data.batch.Batch`es; the loaders stack them into one `Batch` per
micro batch (`collate`), the one type every model reads, by field.

Text corpora are tokenized into cached token stores (loom.data.tokens) by the launcher before
the ranks start, or else in `prepare_data` (Lightning calls it on local rank 0 of each node,
then every rank waits at a barrier); `setup` only opens the stores.

`LOOM_RECORD_SAMPLE_IDS=<dir>` (a test hook, off the hot path when unset): every rank appends
`<global step> <epoch> <sample ids...>` for each micro batch it trained on to
`<dir>/rank-<global rank>.txt`. The ids are those the loader actually fetched (the train set
is wrapped to note each index it serves, in order), matched to trained batches by
`DataPosition`; exact with hardware.dataloader_workers=0 (workers fetch in other processes).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from pathlib import Path

import pytorch_lightning as pl
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from loom.data.batch import collate
from loom.data.registry import DATASETS
from loom.data.sampler import ResumableDistributedSampler
from loom.schema import load

RECORD_ENV = "LOOM_RECORD_SAMPLE_IDS"
log = logging.getLogger("loom")


class _Noting(Sampler):
    """Wraps the train sampler and notes every index it hands out, in order (LOOM_RECORD_SAMPLE_IDS
    only). At the sampler, not the dataset: a loader's workers read the dataset in their own
    processes, while the sampler runs in this one, in the order the batches arrive."""

    def __init__(self, inner: ResumableDistributedSampler, served: deque) -> None:
        self.inner, self.served = inner, served

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for i in self.inner:
            self.served.append(int(i[0]) if isinstance(i, tuple) else int(i))  # chat: (id, scale)
            yield i


def _counter_row(first: int, worker_id: int) -> None:
    from loom.data.store.remote.stats import claim_row

    claim_row(first + worker_id)


class LoomDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DictConfig, dp_rank: int, dp_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.train_sampler: ResumableDistributedSampler | None = None
        self.resume_position: tuple[int, int] | None = None  # (epoch, samples of its global order consumed)
        tr = cfg.trainer  # samples per optimizer step: the run's, at any dp
        self.global_batch = int(tr.get("global_batch_size") or
                                cfg.dataset.batch_size * tr.accumulate_grad_batches * dp_size)
        record = os.environ.get(RECORD_ENV)
        self.record_dir = Path(record) if record else None
        self._served: deque = deque()

    # ------------------------------------------------------------------ building the sets
    def _build(self) -> tuple[Dataset, Dataset | None]:
        return load(DATASETS[self.cfg.dataset.name].datasets)(self.cfg)

    def prepare_data(self) -> None:
        """Local rank 0: a text front end's stores, tokenized into the cache where the launcher
        did not (a SLURM job), in this process (a no-op when they are there)."""
        make = DATASETS[self.cfg.dataset.name].stores
        if make is not None:
            make(self.cfg, 1)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.train_set, self.val_set = self._build()
        if len(self.train_set) < self.global_batch:
            raise ValueError(
                f"dataset={self.cfg.dataset.name}: the training split has {len(self.train_set)} samples, "
                f"fewer than one global batch ({self.global_batch} = dataset.batch_size="
                f"{self.cfg.dataset.batch_size} x accumulation x {self.dp_size} data-parallel ranks); "
                "use more data or a smaller batch")
        self._announce()

    def _announce(self) -> None:
        """The dataset line (the console shows rank 0's), and a validation split that validates
        nothing: a warning, or an error when validation is asked for periodically."""
        from loom.data.checks import val_problem
        from loom.data.describe import summary_line

        log.info(summary_line(self.cfg, self.train_set, self.val_set, self.dp_size))
        off = self.cfg.dataset.get("val_every", 2) <= 1  # the user turned the split off
        sets = self._val_sets()
        small = [v for v in sets if len(v) // self.dp_size < self.cfg.dataset.batch_size]
        if len(sets) > 1 and small:  # a mixture: sources too small to validate are left out, said once
            log.warning("warning: validation leaves out source(s) %s: fewer windows than one batch per rank",
                        ", ".join(getattr(v, "name", "?") for v in small))
            self.val_set = [v for v in sets if v not in small] or None
            sets = self.val_set or []
        problem = val_problem(self.cfg, sum(len(v) for v in sets), self.dp_size)
        if problem and self.cfg.trainer.val_every_n_steps > 0:
            raise ValueError(f"{problem}, but trainer.val_every_n_steps={self.cfg.trainer.val_every_n_steps} "
                             "asks for it; add data, lower dataset.val_every or dataset.batch_size, or set "
                             "trainer.val_every_n_steps=0")
        if problem and not off:
            log.warning(f"warning: {problem}; the run reports no validation loss")

    # ------------------------------------------------------------------ loaders
    def _loader(self, dataset, sampler) -> DataLoader:
        hw = self.cfg.hardware
        workers = hw.dataloader_workers
        kw = {"prefetch_factor": hw.get("prefetch_factor") or 2} if workers > 0 else {}  # hardware profile
        if workers > 0:  # each worker its own row of the storage counters (train 1..n, validation n+1..2n)
            kw["worker_init_fn"] = functools.partial(_counter_row, 1 + workers * int(dataset is not self.train_set))
        return DataLoader(
            dataset,
            batch_size=self.cfg.dataset.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=hw.pin_memory,
            persistent_workers=workers > 0,
            drop_last=True,
            collate_fn=collate,
            **kw,
        )

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = ResumableDistributedSampler(
            self.train_set, num_replicas=self.dp_size, rank=self.dp_rank, micro_batch=self.cfg.dataset.batch_size,
            global_batch=self.global_batch, shuffle=True, seed=self.cfg.seed, prefetch_ahead=getattr(self.train_set, "prefetch_ahead", 0),
        )
        if self.resume_position is not None:  # set at checkpoint restore (loom.data.position), before any iteration
            self.train_sampler.resume_at(*self.resume_position)
        sampler = _Noting(self.train_sampler, self._served) if self.record_dir else self.train_sampler
        return self._loader(self.train_set, sampler)

    @property
    def val_names(self) -> list[str]:
        """One name per validation loader: a mixture's sources (`val/loss/<name>`), else the set's."""
        return [getattr(v, "name", self.cfg.dataset.name) for v in self._val_sets()]

    def _val_sets(self) -> list[Dataset]:
        return self.val_set if isinstance(self.val_set, list) else [] if self.val_set is None else [self.val_set]

    def val_windows(self, available: int) -> int:
        """How many of a validation set's first windows a validation evaluates: trainer.limit_val_batches
        global batches (the global batch is the run's at any world size, so these are the same windows
        at any dp), split evenly over the data-parallel ranks; a set holding fewer, its whole global
        batches; one holding less than one global batch, what one batch per rank takes of it."""
        want = int(self.cfg.trainer.limit_val_batches) * self.global_batch
        if available >= want:
            return want
        unit = int(self.cfg.dataset.batch_size) * self.dp_size
        return available // self.global_batch * self.global_batch or available // unit * unit

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Each set's first `val_windows` windows, in order, dealt to the ranks (the Trainer takes them all)."""
        subsets = [Subset(v, range(self.val_windows(len(v)))) for v in self._val_sets()]
        loaders = [self._loader(v, DistributedSampler(v, num_replicas=self.dp_size, rank=self.dp_rank,
                                                     shuffle=False, drop_last=True)) for v in subsets]
        return loaders if isinstance(self.val_set, list) or not loaders else loaders[0]

    def source_report(self) -> dict | None:
        """What a mixture drew from each source in the samples trained so far (summary.json)."""
        consumed = getattr(self.train_set, "consumed", None)
        position = self._samples_trained() if consumed is not None and self.trainer is not None else None
        return None if position is None else {"sources": consumed(position)}

    def _samples_trained(self) -> int | None:
        """Samples of the global order trained, over every epoch so far (DataPosition)."""
        from loom.data.position import DataPosition

        for cb in self.trainer.callbacks:
            if isinstance(cb, DataPosition):
                micro = int(self.cfg.dataset.batch_size)
                per_epoch = self.train_sampler.epoch_samples() if self.train_sampler else 0
                return cb.epoch * per_epoch + cb.batches * micro * self.dp_size
        return None

    # ------------------------------------------------------------------ recording (tests)
    def record_trained_batch(self, global_rank: int, step: int, epoch: int) -> None:
        """Called by DataPosition after each trained micro batch when recording is on."""
        n = self.cfg.dataset.batch_size
        ids = [self._served.popleft() for _ in range(min(n, len(self._served)))]
        self.record_dir.mkdir(parents=True, exist_ok=True)
        with open(self.record_dir / f"rank-{global_rank}.txt", "a") as f:
            f.write(f"{step} {epoch} {' '.join(map(str, ids))}\n")
