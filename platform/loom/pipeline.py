"""One run, top to bottom: compose -> validate -> plan -> freeze -> launch -> finish.

The only place that calls every stage. `loom train` (one run or each trial of a sweep) and
`loom plan` go through here; the heavy imports (torch, Lightning) load only in the launched
ranks (or in-process, for a one-device run), after the config is valid and the plan fits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from loom import data, strategies
from loom.compose import compose
from loom.compose.hydra_options import launcher_debug
from loom.errors import EXIT_INFEASIBLE, EXIT_OK, ConfigError
from loom.finish import finish, launch_mark
from loom.freeze import freeze
from loom.hardware.machine import check_machine
from loom.hardware.schema import SUBMITTED
from loom.launch import launch, multi_node
from loom.packages import TRAINING, check_needs
from loom.plan import Plan, make_plan
from loom.plan.assumptions import assumptions
from loom.plan.auto import auto_choice_of, choose
from loom.plan.render import infeasible_message, render
from loom.rundir.checkpoints import UnsafeCheckpoint, newest_checkpoint
from loom.rundir.lock import run_lock, wait_for_ranks
from loom.rundir.summary import read_summary, summary_mark
from loom.schema import load
from loom.tracking.checks import tracking_checks
from loom.validate import package_needs, validate

Outcome = tuple[int, Path | None, str | None]  # (exit code, run dir, error)


def resolve(overrides: list[str]) -> DictConfig:
    """The validated config of one run: compose, then validate (strategy=auto: the best
    layout that fits, validated, in place of auto)."""
    composed = compose(overrides)
    if composed.strategy.get("name") == strategies.AUTO:
        return choose(composed)
    return validate(composed)


_WARNED: set[str] = set()  # plan warnings already printed by this command (a sweep plans every trial)


def plan_run(cfg: DictConfig, show: bool, overrides: list[str] | None = None) -> Plan:
    """The plan; its table when asked (`loom plan`) or when the run cannot fit; warnings
    (e.g. MFU null for a device without a known peak) as one line each on stderr, once per
    command: a sweep's trials share them. `overrides` (the command's) name the user's keys in
    plan.json `assumptions` (where seq_len and the batch came from)."""
    plan = make_plan(cfg)
    plan.auto_choice = auto_choice_of(cfg)
    plan.assumptions = assumptions(cfg, overrides or [], plan.auto_choice)
    if show or not plan.fits:
        render(plan.to_dict())
    for w in plan.warnings:
        if w not in _WARNED:
            _WARNED.add(w)
            print(f"warning: {w}", file=sys.stderr)
    return plan


def plan_inputs(cfg: DictConfig) -> dict:
    """What the plan is computed from (`hydra.verbose`): the layout, the batch and the machine."""
    hw, ds, tr = cfg.hardware, cfg.dataset, cfg.trainer
    layout = strategies.layout_of(cfg)
    return {"strategy": cfg.strategy.name, "world": layout.world, "parallel": layout.parallel(),
            "model": cfg.model.name, "micro_batch": ds.batch_size, "seq_len": ds.get("seq_len"),
            "accumulation": tr.accumulate_grad_batches, "precision": hw.precision,
            "accelerator": hw.accelerator, "devices": hw.devices, "num_nodes": hw.num_nodes,
            "host_memory_gb": hw.get("host_memory_gb"), "device_memory_gb": hw.get("device_memory_gb")}


def refuse_infeasible(plan: Plan) -> int:
    print(infeasible_message(plan.to_dict()), file=sys.stderr)
    return EXIT_INFEASIBLE


def train_one(overrides: list[str], cfg: DictConfig | None = None, dry_run: bool = False) -> Outcome:
    """validate -> plan -> freeze -> launch -> finish for one run."""
    cfg = cfg if cfg is not None else resolve(overrides)
    launcher_debug(lambda: "composed config (before freeze):\n" + OmegaConf.to_yaml(cfg, resolve=False))
    check_needs(cfg, package_needs(), TRAINING)  # what only training needs: trackers, launchers, sweeps
    tracking_checks(cfg)
    check_machine(cfg, dry_run=dry_run)
    plan = plan_run(cfg, show=False, overrides=overrides)
    launcher_debug(lambda: f"plan inputs: {plan_inputs(cfg)}")
    if not plan.fits:
        return refuse_infeasible(plan), None, "plan infeasible"
    frozen = freeze(cfg, plan)
    if frozen.state == "completed":
        print(frozen.message or f"Run {frozen.run_id} already completed: {frozen.run_dir}\n"
              "Nothing to do. Change an override or set run.id=<new id> to train a new run.")
        return EXIT_OK, frozen.run_dir, None
    cfg.run.id = frozen.run_id
    if cfg.hardware.launcher in SUBMITTED:  # submitted (exit 0): the job trains later, on the scheduler's nodes
        _check_newest_checkpoint(frozen.run_dir)
        return load(SUBMITTED[cfg.hardware.launcher][0])(cfg, frozen.run_dir, dry_run), frozen.run_dir, None
    # One launcher per run dir (every node of a multi-node run shares it): a second launch of a
    # running run exits 2 here, before it touches a file of the run.
    seen = summary_mark(frozen.run_dir)
    with run_lock(frozen.run_dir, frozen.run_id, shared=multi_node(cfg)):
        if not multi_node(cfg):  # the nodes of a multi-node run join ranks already training
            wait_for_ranks(frozen.run_dir, frozen.run_id)  # an earlier launch's ranks are gone: one live attempt
        if summary_mark(frozen.run_dir) != seen and (read_summary(frozen.run_dir) or {}).get("status") == "completed":
            # Another launcher completed it between freeze and the lock, and just let go.
            print(f"Run {frozen.run_id} already completed: {frozen.run_dir}\nNothing to do.")
            return EXIT_OK, frozen.run_dir, None
        _check_newest_checkpoint(frozen.run_dir)
        print(frozen.message or f"{'Resuming' if frozen.state == 'resume' else 'Starting'} run {frozen.run_id} "
              f"in {frozen.run_dir}", flush=True)
        data.prepare_stores(cfg)  # a text corpus tokenized once, with every core, before the ranks wait on it
        mark = launch_mark(frozen.run_dir)  # what rank 0 and failing ranks write during this launch
        rc = launch(cfg, strategies.layout_of(cfg), frozen.run_dir)
        return finish(cfg, frozen.run_dir, rc, mark), frozen.run_dir, None


def _check_newest_checkpoint(run_dir: Path) -> None:
    try:
        newest_checkpoint(run_dir)
    except UnsafeCheckpoint as e:
        raise ConfigError(str(e)) from None
