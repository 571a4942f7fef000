"""Tracking (conf/tracking/): loggers (CSV, wandb, TensorBoard, MLflow), the step recorder, plots.

The package top is torch-free: the schema, the tracker registry (its normalize fills the MLflow
store, its check refuses a bad MLflow URI), and the launcher-side checks of `checks.py` (the
trackers' packages are installed; an online wandb run needs a key; run by `loom train` only, as
it asks this machine)."""

from __future__ import annotations

from loom.tracking.registry import check, normalize
from loom.tracking.schema import SCHEMAS

__all__ = ["SCHEMAS", "check", "normalize"]
