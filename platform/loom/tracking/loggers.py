"""Lightning loggers for a run: metrics.csv in the run dir and one offline wandb run."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv on start; a resumed run must
    keep its history, so this one keeps the file (and its header) instead."""

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
    path = run_dir / "metrics.csv"
    if not path.exists():
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames or [], list(reader)
    keep = [r for r in rows if r.get("step") in (None, "") or int(float(r["step"])) <= after_step]
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(keep)
    os.replace(tmp, path)


def build_loggers(cfg: DictConfig, run_dir: Path, run_id: str) -> list:
    loggers: list = []
    if cfg.tracking.csv:
        loggers.append(RunCSVLogger(run_dir))
    if cfg.tracking.wandb:
        from pytorch_lightning.loggers import WandbLogger

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        logger = WandbLogger(
            save_dir=str(run_dir),
            project=cfg.tracking.project,
            entity=cfg.tracking.entity,
            id=run_id,  # the Loom run id: a resume continues the same wandb run
            name=f"{cfg.experiment}/{run_id}",
            resume="allow",
            log_model=False,
        )
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
        loggers.append(logger)
    return loggers
