"""One run, top to bottom: compose -> validate -> plan -> freeze -> launch -> finish.

The only place that calls every stage. `loom train` (one run or each trial of a sweep) and
`loom plan` go through here; the heavy imports (torch, Lightning) load only in the launched
ranks (or in-process, for a one-device run), after the config is valid and the plan fits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from loom import strategies
from loom.compose import compose
from loom.errors import EXIT_INFEASIBLE, EXIT_OK, ConfigError
from loom.finish import finish
from loom.freeze import freeze
from loom.hardware.machine import check_machine
from loom.launch import launch
from loom.plan import Plan, make_plan
from loom.plan.render import infeasible_message, render
from loom.rundir.checkpoints import UnsafeCheckpoint, newest_checkpoint
from loom.rundir.summary import summary_mark
from loom.tracking.checks import tracking_checks
from loom.validate import validate

Outcome = tuple[int, Path | None, str | None]  # (exit code, run dir, error)


def resolve(overrides: list[str]) -> DictConfig:
    """The validated config of one run: compose, then validate."""
    return validate(compose(overrides))


def plan_run(cfg: DictConfig, show: bool) -> Plan:
    """The plan; its table when asked (`loom plan`) or when the run cannot fit; warnings
    (e.g. MFU null for a device without a known peak) as one line each on stderr."""
    plan = make_plan(cfg)
    if show or not plan.fits:
        render(plan.to_dict())
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return plan


def refuse_infeasible(plan: Plan) -> int:
    print(infeasible_message(plan.to_dict()), file=sys.stderr)
    return EXIT_INFEASIBLE


def train_one(overrides: list[str], cfg: DictConfig | None = None, dry_run: bool = False) -> Outcome:
    """validate -> plan -> freeze -> launch -> finish for one run."""
    cfg = cfg if cfg is not None else resolve(overrides)
    tracking_checks(cfg)
    check_machine(cfg, dry_run=dry_run)
    plan = plan_run(cfg, show=False)
    if not plan.fits:
        return refuse_infeasible(plan), None, "plan infeasible"
    frozen = freeze(cfg, plan)
    if frozen.state == "completed":
        print(f"Run {frozen.run_id} already completed: {frozen.run_dir}\n"
              "Nothing to do. Change an override or set run.id=<new id> to train a new run.")
        return EXIT_OK, frozen.run_dir, None
    try:
        newest_checkpoint(frozen.run_dir)
    except UnsafeCheckpoint as e:
        raise ConfigError(str(e)) from None
    cfg.run.id = frozen.run_id
    if cfg.hardware.launcher == "slurm":  # submitted (exit 0): the job trains later, in the allocation
        from loom.launch.slurm import submit

        return submit(cfg, frozen.run_dir, dry_run), frozen.run_dir, None
    print(frozen.message or f"{'Resuming' if frozen.state == 'resume' else 'Starting'} run {frozen.run_id} "
          f"in {frozen.run_dir}", flush=True)
    mark = summary_mark(frozen.run_dir)  # did rank 0 write summary.json during this launch?
    rc = launch(cfg, strategies.layout_of(cfg), frozen.run_dir)
    return finish(cfg, frozen.run_dir, rc, mark), frozen.run_dir, None
