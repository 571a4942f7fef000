"""The trackers a run can log to, one entry each: when the config turns it on, the package it
needs (checked at validation, torch-free) and its `"module:function"` builder (imported in the
worker only, so the launcher stays free of torch, Lightning and the tracker itself).

Adding a tracker: a flag or node in `schema.TrackingConfig`, an entry here, a builder
`(cfg, run_dir, run_id) -> Lightning logger | None`, and a conf/tracking/<name>.yaml."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from loom.errors import ConfigError, require
from loom.packages import TRAINING, Need

# MLflow tracking URI schemes Loom passes through (a plain path is a local file store).
MLFLOW_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")


@dataclass(frozen=True)
class Tracker:
    enabled: Callable[[DictConfig], bool]  # on the `tracking` node
    module: str | None                     # the import name the builder needs (None: core)
    builder: str                           # "module:function"
    switch: str                            # the key that turns it on beside another option
    options: tuple[str, ...]               # the tracking options (conf/tracking/) that turn it on themselves


TRACKERS: dict[str, Tracker] = {
    "csv": Tracker(lambda tr: bool(tr.csv), None, "loom.tracking.loggers:build_csv", "tracking.csv",
                   ("offline", "csv", "wandb", "tensorboard", "mlflow")),
    "wandb": Tracker(lambda tr: bool(tr.wandb) and tr.mode != "disabled", "wandb",
                     "loom.tracking.loggers:build_wandb", "tracking.wandb", ("offline", "wandb")),
    "tensorboard": Tracker(lambda tr: bool(tr.get("tensorboard")), "tensorboard",
                           "loom.tracking.loggers:build_tensorboard", "tracking.tensorboard", ("tensorboard",)),
    "mlflow": Tracker(lambda tr: bool(tr.get("mlflow") and tr.mlflow.enabled), "mlflow",
                      "loom.tracking.mlflow_run:build_mlflow", "tracking.mlflow.enabled", ("mlflow",)),
}


def _option(tr: DictConfig, tracker: str) -> str:
    """How the user turned `tracker` on: the option itself, or a key added to another option."""
    if tr.name in TRACKERS[tracker].options:
        return f"tracking={tr.name}"
    return f"{TRACKERS[tracker].switch}=true (tracking={tr.name})"


# Each tracker's package (loom.packages' table), checked by `loom train` only: a plan needs no tracker.
NEEDS: tuple[Need, ...] = tuple(
    Need(f"tracking={' or '.join(t.options)}, or {t.switch}=true", lambda cfg, t=t: t.enabled(cfg.tracking), t.module,
         example=(f"tracking={t.options[0]}",), instead="tracking=csv (metrics.csv only)", checked=TRAINING,
         says=lambda cfg, name=name: _option(cfg.tracking, name))
    for name, t in TRACKERS.items() if t.module)


def enabled_trackers(tracking: DictConfig) -> list[str]:
    """The trackers `tracking` turns on, in the order the loggers are built (CSV first)."""
    return [name for name, t in TRACKERS.items() if t.enabled(tracking)]


def normalize(cfg: DictConfig) -> None:
    """An MLflow run without a URI gets the run root's file store, written absolute into the
    frozen config (a relative path would follow the worker's working directory)."""
    ml = cfg.tracking.get("mlflow")
    if not (ml and ml.enabled):
        return
    if ml.uri is None:
        ml.uri = f"file:{(Path(cfg.run.root) / 'mlruns').resolve()}"
    elif "://" not in str(ml.uri) and not str(ml.uri).startswith(("file:", "databricks")):
        ml.uri = f"file:{Path(str(ml.uri)).expanduser().resolve()}"  # a plain path: a file store


def check(cfg: DictConfig, layout: object) -> None:
    """The straggler rule's numbers; tracking.mlflow.uri: a scheme MLflow knows, and no
    credentials (they would be frozen into config.yaml and logged; MLflow reads them from its
    environment variables)."""
    tr = cfg.tracking
    threshold, window = tr.straggler_threshold, tr.straggler_window  # typed: the schema's defaults filled in
    require(threshold > 0, "tracking.straggler_threshold", threshold,
            "must be > 0 (a fraction of the median step time, e.g. 0.2)")
    require(window >= 1, "tracking.straggler_window", window, "must be a number of log steps >= 1")
    ml = tr.get("mlflow")
    if not (ml and ml.enabled):
        return
    uri = str(ml.uri)
    parsed = urlparse(uri)
    if parsed.password or parsed.username:
        raise ConfigError(
            "Invalid config: tracking.mlflow.uri holds credentials (user:password@host), which would be "
            "written to config.yaml; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) in the environment and give the URI without them."
        )
    require((parsed.scheme or uri) in MLFLOW_SCHEMES, "tracking.mlflow.uri", uri,
            f"is not an MLflow tracking URI; valid schemes: {', '.join(MLFLOW_SCHEMES)} "
            "(or a path: a local file store; null: <run.root>/mlruns)")
