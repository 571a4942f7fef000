"""Tracking (conf/tracking/): loggers (CSV, wandb offline), the step recorder, plots.

The package top is torch-free: the schema, and the launcher-side checks of `checks.py`
(an online wandb run needs a key; run by `loom train` only, as it asks this machine)."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.tracking.schema import SCHEMAS

__all__ = ["SCHEMAS", "check", "normalize"]


def normalize(cfg: DictConfig) -> None:
    """The tracking values are used as written."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Nothing beyond the schema: whether wandb can log from here is `checks.tracking_checks`."""
