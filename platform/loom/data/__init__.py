"""Datasets as config groups (conf/dataset/): every option yields (train, val) map-style
datasets behind one LightningDataModule with resumable distributed sampling.

This package's top level stays free of torch: `items_per_sample` and validation
(`loom.data.check`) run in the launcher before torch is imported.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

# Options that yield (input tokens, next tokens) of dataset.seq_len; the others yield
# (feature tensor, class label).
TOKEN_DATASETS = ("tinycode", "text_files", "hf")


def is_token_data(ds: DictConfig) -> bool:
    return ds.name in TOKEN_DATASETS or (ds.name == "synthetic" and ds.kind == "tokens")


def items_per_sample(cfg: DictConfig) -> int:
    """What "tokens" counts per sample: seq_len for token data, 1 for a classified sample."""
    return int(cfg.dataset.seq_len) if is_token_data(cfg.dataset) else 1


def build_datamodule(cfg: DictConfig, dp_rank: int, dp_size: int) -> Any:
    """The run's LightningDataModule (imports torch and Lightning)."""
    from loom.data.module import LoomDataModule

    return LoomDataModule(cfg, dp_rank, dp_size)
