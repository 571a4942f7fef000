"""One MLflow run per Loom run, through Lightning's MLFlowLogger: params (the redacted frozen
config), the step metrics under the names metrics.csv and wandb use, and the outcome (summary.json
as an artifact, its numbers as `summary/...` metrics). The MLflow run id is kept in
`<run>/mlflow.json`, so a resume (same run dir) logs into the same MLflow run."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig
from pytorch_lightning.loggers import MLFlowLogger
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from loom.atomic import atomic_write_text
from loom.redaction import redact
from loom.rundir.config_file import frozen_container
from loom.rundir.paths import RunDir
from loom.tracking.loggers import Guarded

log = logging.getLogger("loom")


class SafeMLFlowLogger(Guarded, MLFlowLogger):
    """A guarded MLFlowLogger that can also record the run's summary after training."""

    tracker = "mlflow"

    def log_summary(self, summary: dict) -> None:
        """summary.json as the artifact `summary.json`; its numbers (nested keys joined by '/')
        as metrics `summary/<key>` at the final step; the run ends FINISHED or FAILED by it."""
        def record() -> None:
            client, run_id = self.experiment, self.run_id
            safe = redact(summary)
            client.log_dict(run_id, safe, RunDir.summary.rel)
            step = int(summary.get("global_step") or 0)
            for key, value in _numbers(safe).items():
                client.log_metric(run_id, f"summary/{key}", value, step=step)
            client.set_terminated(run_id, "FINISHED" if summary.get("status") == "completed" else "FAILED")

        self._guarded("log_summary", record)


def _numbers(d: Mapping, prefix: str = "") -> dict[str, float]:
    """The int/float leaves of nested dicts (no lists, no booleans), keys joined by '/'."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_numbers(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _stored_run(run_dir: Path, uri: str) -> str | None:
    """The MLflow run id an earlier attempt of this run created in the same store, if any."""
    path = RunDir(run_dir).mlflow
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record.get("run_id") if record.get("tracking_uri") == uri else None


def build_mlflow(cfg: DictConfig, run_dir: Path, run_id: str) -> SafeMLFlowLogger | None:
    """Rank 0 only (MLflow is written by rank 0; the other ranks skip its import)."""
    if rank_zero_only.rank != 0:
        return None
    ml = cfg.tracking.mlflow
    uri = str(ml.uri)
    if uri.startswith("file:"):  # MLflow 3 keeps the file store behind an explicit opt-in
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    stored = _stored_run(run_dir, uri)
    logger = SafeMLFlowLogger(
        experiment_name=ml.experiment or cfg.experiment,
        run_name=f"{cfg.experiment}/{run_id}",
        tracking_uri=uri,
        tags={"loom.run_id": run_id, "loom.run_dir": str(run_dir)},
        run_id=stored,
    )
    params = frozen_container(cfg)  # secrets redacted, env refs unresolved
    logger.log_hyperparams(params)
    if logger.disabled:
        return logger
    if stored:
        logger.experiment.update_run(stored, status="RUNNING")
        log.info(f"mlflow: continuing run {stored} in {uri}")
    else:
        record = {"run_id": logger.run_id, "experiment_id": logger.experiment_id, "tracking_uri": uri}
        atomic_write_text(RunDir(run_dir).mlflow, json.dumps(record, indent=2) + "\n")
        log.info(f"mlflow: run {logger.run_id} in {uri}")
    return logger
