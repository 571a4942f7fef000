"""Multirun sweeps whose trials are full distributed jobs, resumable through a manifest.

Hydra's multirun launches jobs in-process (and Lightning's DDP launcher then re-runs the
script per rank); here the sweeper's override grammar enumerates trials (BasicSweeper for a
grid, hydra-optuna-sweeper's distributions + an Optuna study for search) and each trial goes
through Loom's own path: validate -> plan -> freeze -> torchrun. The manifest records every
trial's overrides and state, so re-running the sweep command skips what completed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.atomic import atomic_write_text
from loom.errors import ConfigError
from loom.models import experiment_of
from loom.packages import TRAINING, check_needs
from loom.rundir.eval_results import objective_of
from loom.rundir.paths import RunDir, SweepDir
from loom.schema import eval_objective, objective_direction, objective_problem
from loom.validate import evaluated_tasks, package_needs

# Hydra's own spellings for the sweeper, accepted as aliases of Loom's `sweep.*` keys.
ALIASES = {
    "hydra/sweeper=optuna": "sweep.sampler=optuna",
    "hydra/sweeper=basic": "sweep.sampler=grid",
    "hydra.sweeper.n_trials": "sweep.n_trials",
    "hydra.sweeper.direction": "sweep.direction",
    "hydra.sweeper.sampler.seed": "sweep.seed",
}
# How the trials are ranked, not what they train: not part of the sweep's identity, so the same
# sweep with another objective re-ranks its finished trials instead of training them again.
RANKING_KEYS = ("sweep.objective", "sweep.direction")
# Swept keys that change what a run costs, not what it learns: every strategy and hardware profile
# trains the same losses by design (the parity tests), activation checkpointing and compile are the
# same math, and a batch-size sweep is a throughput and memory study. A sweep of these alone
# defaults its objective to throughput (its losses tie; the report says so).
SPEED_KEYS = ("strategy", "hardware", "dataset.batch_size", "trainer.activation_checkpointing", "trainer.compile")


def translate(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if o in ALIASES:
            out.append(ALIASES[o])
        elif key in ALIASES:
            out.append(f"{ALIASES[key]}={value}")
        else:
            out.append(o)
    return out


def split_sweep(overrides: list[str]) -> tuple[list[str], list[Any]]:
    """(fixed overrides, parsed sweep overrides) using Hydra's override grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed, sweeps = [], []
    for text in overrides:
        parsed = parser.parse_overrides([text])[0]
        if parsed.is_sweep_override():
            sweeps.append(parsed)
        else:
            fixed.append(text)
    return fixed, sweeps


def grid(sweeps: list[Any]) -> list[list[str]]:
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    for s in sweeps:
        if s.value_type is not None and "INTERVAL" in str(s.value_type):
            raise ConfigError(
                f"Invalid sweep: {s.input_line} is a search interval; a grid needs a list. "
                "Use hydra/sweeper=optuna (sweep.sampler=optuna) to search an interval."
            )
    return BasicSweeper.split_arguments(sweeps, None)[0] if sweeps else [[]]


@dataclass
class Trial:
    index: int
    overrides: list[str]
    state: str = "pending"      # pending | running | submitted (SLURM) | completed | failed
    run_id: str | None = None
    run_dir: str | None = None
    exit_code: int | None = None
    objective: float | None = None
    error: str | None = None
    params: dict[str, Any] | None = None
    job_id: str | None = None   # SLURM: the batch job that runs the trial


class Manifest:
    """manifest.json: the sweep's command, its objective (what `loom report` ranks the trials
    by) and every trial's overrides, swept values (`params`), state and objective value."""

    def __init__(self, path: Path, sweep_id: str, command: list[str], objective: str = "final_loss",
                 direction: str = "minimize") -> None:
        self.path = path
        self.sweep_id = sweep_id
        self.command = command
        self.objective, self.direction = objective, direction
        self.trials: list[Trial] = []
        if path.exists():
            data = json.loads(path.read_text())
            self.trials = [Trial(**t) for t in data["trials"]]

    def save(self) -> None:
        data = {"sweep_id": self.sweep_id, "command": self.command, "objective": self.objective,
                "direction": self.direction, "trials": [t.__dict__ for t in self.trials]}
        atomic_write_text(self.path, json.dumps(data, indent=2) + "\n")

    def trial(self, index: int, overrides: list[str], params: dict | None = None) -> Trial:
        for t in self.trials:
            if t.index == index:
                return t
        t = Trial(index, overrides, params=params)
        self.trials.append(t)
        self.save()
        return t


def trial_objective(t: Trial, run_dir: Path, name: str) -> float | None:
    """The trial's objective value from its run dir (summary.json, and eval/ for `eval/<task>/<metric>`);
    a completed trial without one says so (an evaluation that failed or never ran that task)."""
    value = objective_of(json.loads(RunDir(run_dir).summary.read_text()), name, run_dir)
    if value is None and _completed(run_dir):
        print(f"[sweep] trial {t.index}: its summary has no {name}"
              + (" (no evaluation scored it: see summary.json `eval`)" if eval_objective(name) else ""), flush=True)
    return value


RunTrial = Callable[[list[str]], tuple[int, Path | None, str | None]]


def run_sweep(
    overrides: list[str],
    base: DictConfig,
    resolve: Callable[[list[str]], DictConfig],
    run_trial: RunTrial,
) -> tuple[Path, Manifest]:
    """Enumerate, validate and run every trial; returns the sweep dir and its manifest."""
    fixed, sweeps = split_sweep(overrides)
    for key, value in (base.sweep.params or {}).items():
        if not any(s.key_or_group == key for s in sweeps):
            _, extra = split_sweep([f"{key}={value}"])
            sweeps += extra
    sampler = base.sweep.sampler
    if sampler not in ("grid", "optuna"):
        raise ConfigError(f"Invalid config: sweep.sampler={sampler!r}: valid choices: grid, optuna.")
    check_needs(base, package_needs(), TRAINING)  # Optuna's package before the study is made
    if sampler == "optuna" and base.hardware.get("launcher") == "slurm":
        raise ConfigError(
            "Invalid config: sweep.sampler=optuna with hardware=slurm: Optuna needs each trial's result "
            "before it picks the next, and SLURM trials finish later. Use a grid sweep on SLURM."
        )
    problem = objective_problem(str(base.sweep.objective), *evaluated_tasks(base))
    if problem is not None:  # the grid's best trial is ranked by it too
        raise ConfigError(f"Invalid config: {problem}")
    if base.sweep.direction not in ("minimize", "maximize"):
        raise ConfigError(f"Invalid config: sweep.direction={base.sweep.direction!r}: valid choices: minimize, maximize.")
    objective, direction = sweep_objective(base, [s.key_or_group for s in sweeps], overrides)
    identity = sorted(o for o in fixed if o.partition("=")[0].lstrip("+~") not in RANKING_KEYS)
    key = json.dumps({"fixed": identity, "sweep": sorted(s.input_line for s in sweeps),
                      "sampler": sampler, "n": base.sweep.n_trials if sampler == "optuna" else None,
                      "seed": base.sweep.seed})
    sweep_id = hashlib.sha1(key.encode()).hexdigest()[:8]
    sweep_dir = SweepDir.of(base.run.root, experiment_of(base), sweep_id).path.resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(SweepDir(sweep_dir).manifest, sweep_id, overrides, objective, direction)
    pin = [f"run.sweep_dir={sweep_dir}"]

    def own_id(i: int) -> list[str]:
        """A fixed run.id would give every trial the same run: each gets <id>-<index>."""
        return [f"run.id={base.run.id}-{i}"] if base.run.id else []

    if sampler == "grid":
        trials = grid(sweeps)
        for i, trial_overrides in enumerate(trials):  # validate all before running any
            resolve([*fixed, *trial_overrides, *own_id(i), *pin])
        for i, trial_overrides in enumerate(trials):
            params = dict(o.partition("=")[::2] for o in trial_overrides)  # the swept values
            t = manifest.trial(i, [*fixed, *trial_overrides, *own_id(i)], params)
            t.params = t.params or params  # a manifest written before params were recorded
            _run(t, manifest, pin, run_trial, objective)
    else:
        _optuna(fixed, sweeps, base, manifest, pin, resolve, run_trial)
    return sweep_dir, manifest


def speed_only(keys: list[str]) -> bool:
    """Every swept key is one of SPEED_KEYS (or below one: strategy.tensor_parallel, hardware.devices)."""
    return bool(keys) and all(any(k == p or k.startswith(p + ".") for p in SPEED_KEYS) for k in keys)


def sweep_objective(base: DictConfig, keys: list[str], overrides: list[str]) -> tuple[str, str]:
    """(objective, direction) of the sweep: `sweep.objective` and `sweep.direction`, unless neither
    was set (by the command or the recipe) and every swept key is a SPEED_KEY: then throughput,
    maximized (tokens/s; samples/s for a classifier)."""
    from loom.plan.assumptions import set_by

    chosen = (str(base.sweep.objective), str(base.sweep.direction))
    if eval_objective(chosen[0]) is not None:
        return chosen[0], eval_direction(chosen, set_by(overrides, "sweep.direction"))
    if not speed_only(keys) or set_by(overrides, "sweep.objective") or set_by(overrides, "sweep.direction"):
        return chosen
    from loom.models import model_spec

    unit = "tokens_per_sec" if model_spec(base).items_per_sample > 1 else "samples_per_sec"
    objective = f"throughput.{unit}"
    print(f"[sweep] objective: {objective} (maximize): the swept keys ({', '.join(dict.fromkeys(keys))}) change "
          "speed and memory, not the losses; set sweep.objective to rank by another metric", flush=True)
    return objective, "maximize"


def eval_direction(chosen: tuple[str, str], said: bool) -> str:
    """An evaluation objective's direction: sweep.direction when the command sets it, else the metric's
    (EVAL_DIRECTIONS: acc up, perplexity down); a metric not in that table needs sweep.direction."""
    objective, direction = chosen
    known = objective_direction(objective)
    if said or known == direction:
        return direction
    if known is None:
        raise ConfigError(f"Invalid config: sweep.objective={objective}: is a higher {objective.rsplit('/', 1)[-1]} "
                          "better or a lower one? Set sweep.direction=maximize or sweep.direction=minimize.")
    return known


def _run(t: Trial, manifest: Manifest, pin: list[str], run_trial: RunTrial, objective: str) -> None:
    if t.state == "submitted" and t.run_dir:
        _settle_submitted(t, objective)
        manifest.save()
        if t.state == "submitted":
            print(f"[sweep] trial {t.index}: SLURM job {t.job_id} still queued or running", flush=True)
            return
    if t.state == "completed":
        print(f"[sweep] trial {t.index} already completed: {t.run_dir}", flush=True)
        summary = RunDir(t.run_dir).summary if t.run_dir else None
        if summary is not None and summary.is_file():  # ranked by this command's objective
            t.objective = trial_objective(t, Path(t.run_dir), objective)
            manifest.save()
        return
    print(f"[sweep] trial {t.index}: {' '.join(t.overrides)}", flush=True)
    t.state, t.error = "running", None
    manifest.save()
    rc, run_dir, error = run_trial([*t.overrides, *pin])
    t.exit_code, t.error = rc, error
    t.run_dir = str(run_dir) if run_dir else None
    t.run_id = run_dir.name if run_dir else None
    t.state = "completed" if rc == 0 else "failed"
    job_file = RunDir(run_dir).slurm_job if run_dir else None
    if rc == 0 and run_dir and not _completed(run_dir):
        if job_file.exists():
            t.state, t.job_id = "submitted", job_file.read_text().strip()  # a batch job runs it later
        else:  # --dry-run: the job script was written, nothing ran or was submitted
            t.state = "pending"
    if run_dir and RunDir(run_dir).summary.exists():
        t.objective = trial_objective(t, run_dir, objective)
    manifest.save()


def _completed(run_dir: Path) -> bool:
    path = RunDir(run_dir).summary
    return path.exists() and json.loads(path.read_text()).get("status") == "completed"


def _settle_submitted(t: Trial, objective: str) -> None:
    """A submitted trial is completed once its summary says so, still submitted while its job
    is queued or running, else (failed or preempted for good) pending, to be submitted again."""
    from loom.launch.slurm import active_job

    run_dir = Path(t.run_dir)
    if _completed(run_dir):
        t.state = "completed"
        t.objective = trial_objective(t, run_dir, objective)
    elif active_job(run_dir) is None:
        t.state = "pending"


def _optuna(fixed, sweeps, base, manifest, pin, resolve, run_trial) -> None:
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = {s.get_key_element(): create_optuna_distribution_from_override(s) for s in sweeps}
    study = optuna.create_study(direction=manifest.direction,
                                sampler=optuna.samplers.TPESampler(seed=base.sweep.seed))
    for t in manifest.trials:  # replay what an earlier, interrupted sweep already learned
        if t.state == "completed" and t.objective is not None and t.params:
            study.add_trial(optuna.trial.create_trial(params=t.params, distributions=dists, value=t.objective))
    for i in range(base.sweep.n_trials):
        existing = next((t for t in manifest.trials if t.index == i), None)
        if existing and existing.state == "completed":
            print(f"[sweep] trial {i} already completed: {existing.run_dir}", flush=True)
            continue
        if existing and existing.params:
            params = existing.params
            trial = study.ask({k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()})
        else:
            trial = study.ask(dists)
            params = dict(trial.params)
        trial_overrides = [*fixed, *(f"{k}={v}" for k, v in params.items())]
        resolve([*trial_overrides, *pin])
        t = manifest.trial(i, trial_overrides, params)
        _run(t, manifest, pin, run_trial, manifest.objective)
        if t.state == "completed" and t.objective is not None:
            study.tell(trial, t.objective)
        else:  # a failed trial is a failure for the study, not a number
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
