"""Lightning loggers for a run, one per tracker the config turns on (loom.tracking.registry):
metrics.csv in the run dir, one wandb run, TensorBoard event files (MLflow: mlflow_run.py)."""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from loom.atomic import atomic_path
from loom.rundir.config_file import frozen_container
from loom.rundir.paths import RunDir
from loom.schema import load

log = logging.getLogger("loom")


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv on start; a resumed run must
    keep its history, so this one keeps the file (and its header) instead."""

    NAME_METRICS_FILE = RunDir.metrics.rel  # Lightning's own name too; the run dir's says so

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                header = next(csv.reader(f), [])
            self.metrics_keys = list(header)


class RunCSVLogger(CSVLogger):
    """CSVLogger writing `<run>/metrics.csv` directly (no name/version subdirectories)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(save_dir=str(run_dir), name="", version="")

    @property
    def log_dir(self) -> str:
        return self.save_dir

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    def log_hyperparams(self, params=None) -> None:  # the frozen config.yaml is the record
        return None


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """Drop metric rows past the checkpoint a run resumes from: those steps are redone."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or [], list(reader)
    keep = [r for r in rows if r.get("step") in (None, "") or int(float(r["step"])) <= after_step]
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(keep)


class Guarded:
    """A logger whose failures cost the run its record in that tracker, never the run itself.

    Lightning calls loggers inside the training loop, so an exception from a tracker (its files
    on a full disk, its service process or server gone) would kill a training that is otherwise
    fine. Here the first failure is logged once as a warning and the logger disables itself; the
    training, metrics.csv and summary.json carry on."""

    tracker = "tracker"
    disabled = False

    def _guarded(self, what: str, call: Callable[[], Any]) -> None:
        """Run one tracker call; its first failure turns this logger off with one warning."""
        if self.disabled:
            return
        try:
            call()
        except Exception as e:
            self.disabled = True
            log.warning(
                f"{self.tracker} {what} failed ({type(e).__name__}: {e}); {self.tracker} logging is off for "
                "the rest of this run. Training, metrics.csv and summary.json continue."
            )

    # Listed first in a Safe*Logger's bases, these wrap the Lightning logger's own methods.
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._guarded("log_metrics", lambda: super(Guarded, self).log_metrics(metrics, step))

    @rank_zero_only
    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        self._guarded("log_hyperparams", lambda: super(Guarded, self).log_hyperparams(*args, **kwargs))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._guarded("finalize", lambda: super(Guarded, self).finalize(status))


class SafeWandbLogger(Guarded, WandbLogger):
    """A guarded WandbLogger. Also: `finalize` finishes the wandb run (an offline run left to
    wandb's atexit hook was recorded without its exit), and the `anonymous` argument,
    deprecated in wandb 0.31, is not passed."""

    tracker = "wandb"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wandb_init.pop("anonymous", None)
        self.disabled = False

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._guarded("after_save_checkpoint",
                      lambda: super(SafeWandbLogger, self).after_save_checkpoint(checkpoint_callback))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        def finish() -> None:
            WandbLogger.finalize(self, status)
            if self._experiment is not None:
                self._experiment.finish(exit_code=0 if status in ("success", "finished") else 1)

        self._guarded("finish", finish)


def wandb_settings() -> Any:
    """What the wandb run records besides Loom's metrics and (redacted) config: no git state,
    no code, no system metadata (it holds the full argv and the host), no Launch job."""
    import wandb

    return wandb.Settings(
        disable_git=True,
        save_code=False,
        disable_code=True,
        disable_job_creation=True,
        x_disable_meta=True,
        x_disable_machine_info=True,
    )


def wandb_mode(cfg: DictConfig) -> str:
    """tracking.mode, except that WANDB_MODE=offline|disabled in the environment (a CI's kill
    switch) keeps an online config from going online."""
    mode = str(cfg.tracking.mode)
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode == "online" and env in ("offline", "dryrun", "disabled"):
        log.info(f"tracking.mode=online but WANDB_MODE={env}: wandb stays {env}")
        return "offline" if env == "dryrun" else env
    return mode


def build_csv(cfg: DictConfig, run_dir: Path, run_id: str) -> RunCSVLogger:
    return RunCSVLogger(run_dir)


def build_wandb(cfg: DictConfig, run_dir: Path, run_id: str) -> SafeWandbLogger:
    os.environ.setdefault("WANDB_SILENT", "true")
    logger = SafeWandbLogger(
        save_dir=str(run_dir),
        project=cfg.tracking.project,
        entity=cfg.tracking.entity,
        id=run_id,  # the Loom run id: a resume continues the same wandb run
        name=f"{cfg.experiment}/{run_id}",
        resume="allow",
        log_model=False,
        mode=wandb_mode(cfg),
        settings=wandb_settings() if rank_zero_only.rank == 0 else None,
    )
    # Only global rank 0 creates the wandb run (log_hyperparams is rank-zero-only).
    logger.log_hyperparams(frozen_container(cfg))  # secrets redacted, env refs unresolved
    return logger


class SafeTensorBoardLogger(Guarded, TensorBoardLogger):
    """A guarded TensorBoardLogger writing `<run>/tensorboard/events.out.tfevents.*` (a resume
    adds a file beside the first; TensorBoard reads them as one run)."""

    tracker = "tensorboard"


def build_tensorboard(cfg: DictConfig, run_dir: Path, run_id: str) -> SafeTensorBoardLogger | None:
    """Rank 0 only (the others would log nothing): no event writer, no import cost elsewhere."""
    if rank_zero_only.rank != 0:
        return None
    board = RunDir(run_dir).tensorboard
    logger = SafeTensorBoardLogger(save_dir=str(board.parent), name=board.name, version="", default_hp_metric=False)
    logger.log_hyperparams(frozen_container(cfg))  # the hparams tab; secrets redacted
    return logger


def build_loggers(cfg: DictConfig, run_dir: Path, run_id: str) -> list:
    """One Lightning logger per tracker the config turns on (a builder may return None on ranks
    that log nothing)."""

    from loom.tracking.registry import TRACKERS, enabled_trackers

    loggers: list = []
    for name in enabled_trackers(cfg.tracking):
        logger = load(TRACKERS[name].builder)(cfg, run_dir, run_id)
        if logger is not None:
            loggers.append(logger)
    return loggers


def log_summary(loggers: list, summary: dict) -> None:
    """Rank 0, after summary.json is written: the trackers that keep a run's outcome get it."""
    for logger in loggers:
        if hasattr(logger, "log_summary"):
            logger.log_summary(summary)
