"""Tracking (conf/tracking/): loggers (CSV, wandb, TensorBoard, MLflow), the step recorder, plots.

The package top is torch-free: the schema, the tracker registry (its normalize fills the MLflow
store, its check refuses a bad MLflow URI), and the launcher-side checks of `checks.py` (an
online wandb run needs a key; run by `loom train` only, as it asks this machine); the trackers'
packages are rows of loom.packages' table (`NEEDS`), checked by `loom train`."""

from __future__ import annotations

from loom.tracking.registry import NEEDS, check, normalize
from loom.tracking.schema import SCHEMAS

__all__ = ["NEEDS", "SCHEMAS", "check", "normalize"]
