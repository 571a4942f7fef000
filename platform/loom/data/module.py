"""The LightningDataModule for packed token corpora, sharded by data-parallel rank."""

from __future__ import annotations

import pytorch_lightning as pl
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from loom.data import tinycode
from loom.data.sampler import ResumableDistributedSampler
from loom.data.tokens import PackedTokens, build_token_file, cache_root, fingerprint


class TokenDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DictConfig, dp_rank: int, dp_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.train_set: PackedTokens | None = None
        self.val_set: PackedTokens | None = None
        self.train_sampler: ResumableDistributedSampler | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        ds = self.cfg.dataset
        files = tinycode.corpus_files(ds.max_bytes)
        train, val = tinycode.split(files, ds.val_every)
        key = fingerprint(files, ds.max_bytes, ds.val_every)
        root = cache_root(ds.cache_dir)
        self.train_set = PackedTokens(build_token_file(train, root / f"tinycode-{key}.train.u8"), ds.seq_len)
        if val:
            self.val_set = PackedTokens(build_token_file(val, root / f"tinycode-{key}.val.u8"), ds.seq_len)

    def _loader(self, dataset, sampler) -> DataLoader:
        hw = self.cfg.hardware
        workers = hw.dataloader_workers
        return DataLoader(
            dataset,
            batch_size=self.cfg.dataset.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=hw.pin_memory,
            persistent_workers=workers > 0,
            drop_last=True,
        )

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = ResumableDistributedSampler(
            self.train_set, num_replicas=self.dp_size, rank=self.dp_rank,
            shuffle=True, seed=self.cfg.seed, drop_last=True,
        )
        return self._loader(self.train_set, self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        sampler = ResumableDistributedSampler(
            self.val_set, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=False, drop_last=True
        )
        return self._loader(self.val_set, sampler)
