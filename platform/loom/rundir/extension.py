"""Raising `trainer.max_steps` of an existing run: it continues in the same run dir.

The same command with a higher `trainer.max_steps` (and the run's `run.id`: an automatic run
id covers max_steps, so without it the command is a new run) continues a completed or an
interrupted run from its newest checkpoint (a run keeps one at its last step), with the same
tracker run (the wandb id is the run id). The learning-rate schedule from the resume step on
is recomputed for the new total (loom.optim.build.sync_schedule); the steps before it followed
the old one, which plan.json records (`extended_from_steps`: the earlier totals,
`extended_at_steps`: the step each extension continued from). Lowering max_steps is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.atomic import atomic_write_text
from loom.errors import ConfigError
from loom.rundir.checkpoints import complete_checkpoints, step_of
from loom.rundir.config_file import frozen_yaml
from loom.rundir.paths import RunDir
from loom.rundir.summary import read_summary

KEY = "trainer.max_steps"


def max_steps_only(diff: list[str]) -> bool:
    """Whether a frozen-vs-command difference (freeze.config_diff lines) is max_steps alone."""
    return bool(diff) and all(line.startswith(f"{KEY}:") for line in diff)


def is_completed(run_dir: Path, cfg: DictConfig) -> bool:
    """Completed, and to this config's max_steps (not when the config was just extended, e.g.
    by another node of the same multi-node launch)."""
    summary = read_summary(run_dir)
    return bool(summary and summary.get("status") == "completed"
                and int(summary.get("global_step") or 0) >= int(cfg.trainer.max_steps))


def extend(old: DictConfig, cfg: DictConfig, plan: dict[str, Any], run_dir: Path) -> str:
    """Refreeze the run with the raised max_steps (plan.json, then config.yaml) and return the
    line the launcher prints; ConfigError (exit 2) for a lowered one or nothing to continue from."""
    rid, before, after = str(cfg.run.id), int(old.trainer.max_steps), int(cfg.trainer.max_steps)
    summary = read_summary(run_dir) or {}
    completed = summary.get("status") == "completed"
    done = int(summary.get("global_step") or 0)
    ckpts = complete_checkpoints(run_dir)
    step = step_of(ckpts[0]) if ckpts else None
    if after < before:
        at = f", and completed all {done} steps" if completed else ""
        raise ConfigError(
            f"Invalid config: {KEY}={after}: run {rid} in {run_dir} was frozen with {KEY}={before}{at}; "
            f"a run's {KEY} can only be raised (it then continues from its last checkpoint). "
            "Set run.id=<new id> for a new, shorter run."
        )
    if completed and step is None:
        raise ConfigError(
            f"Invalid config: {KEY}={after}: run {rid} in {run_dir} completed {done} steps but kept no "
            "checkpoint to continue from (checkpoint.every_n_steps=0, or it finished before Loom kept "
            f"one at the last step). Start a new run from its weights instead: model.init_from={run_dir} "
            "run.id=<new id>."
        )
    rd = RunDir(run_dir)
    old_plan = _read_json(rd.plan)
    totals, ats = old_plan.get("extended_from_steps", []), old_plan.get("extended_at_steps", [])
    if not (totals and totals[-1] == before and ats and ats[-1] == (step or 0)):  # not twice (multi-node)
        totals, ats = [*totals, before], [*ats, step or 0]
    changes = {"world_changes": old_plan["world_changes"]} if old_plan.get("world_changes") else {}
    plan = {**plan, "extended_from_steps": totals, "extended_at_steps": ats, **changes}
    atomic_write_text(rd.plan, json.dumps(plan, indent=2) + "\n")
    atomic_write_text(rd.config, frozen_yaml(cfg))
    what = "Continuing completed run" if completed else "Resuming run"
    return (f"{what} {rid} from step {step or 0} to {after} in {run_dir} ({KEY} raised from {before}; "
            f"the learning-rate schedule is recomputed for {after} steps from step {step or 0} on)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
