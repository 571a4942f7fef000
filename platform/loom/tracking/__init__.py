"""Tracking (conf/tracking/): loggers (CSV, wandb offline), the step recorder, plots.

The package top is torch-free: the schema, and the launcher-side checks of `checks.py`
(an online wandb run needs a key; run by `loom train` only, as it asks this machine)."""

from __future__ import annotations

# Nothing to check or fill beyond the schema: whether wandb can log from here is the machine-side
# `checks.tracking_checks`, run by `loom train` only.
from loom.schema import no_check as check
from loom.schema import nothing_to_fill as normalize
from loom.tracking.schema import SCHEMAS

__all__ = ["SCHEMAS", "check", "normalize"]

