"""The schema of the tracking options (conf/tracking/): one shape for all of them.

Trackers combine: `tracking=offline tracking.tensorboard=true tracking.mlflow.enabled=true`
logs the same rows to metrics.csv, wandb, TensorBoard and MLflow (loom.tracking.registry)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MlflowConfig:
    enabled: bool = False
    # null: file:<run.root>/mlruns, a local file store beside the runs (one per run root, so every
    # run of the root is one MLflow experiment away); else any MLflow tracking URI: http(s)://host,
    # sqlite:///path/mlflow.db, databricks. Credentials go in MLFLOW_TRACKING_USERNAME/_PASSWORD/_TOKEN.
    uri: str | None = None
    experiment: str | None = None     # the MLflow experiment (null: the run's `experiment`)


@dataclass
class TrackingConfig:
    name: str = "offline"
    wandb: bool = True
    csv: bool = True
    mode: str = "offline"             # wandb mode: offline | online (needs an API key) | disabled
    project: str = "loom"
    entity: str | None = None
    tensorboard: bool = False         # event files under <run>/tensorboard/
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # The straggler rule (loom.tracking.stragglers), owned here: no conf/tracking YAML restates it.
    # A rank whose own time (data wait + forward) exceeds the median rank's by `straggler_threshold`
    # of a step, at `straggler_window` consecutive log steps, is named a straggler.
    stragglers: bool = True           # false: no straggler rule and no <run>/ranks.jsonl
    straggler_threshold: float = 0.2
    straggler_window: int = 5
    # steps before the steady-state window of summary.json `throughput` (null: the first
    # logged window; any window with a compile in it is left out too: loom.tracking.clock)
    warmup_steps: int | None = None


SCHEMAS: dict[str, type] = {"*": TrackingConfig}
MODES = ("offline", "online", "disabled")
