"""`loom`: the command line. compose -> validate -> plan -> freeze -> launch -> finish.

Nothing here imports torch or Lightning before the config is valid and the plan feasible:
a bad config is refused within the first second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from loom.config import ConfigError, compose, validate
from loom.hardware import auto_overrides, check_machine, user_set

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INFEASIBLE = 0, 1, 2, 3


def resolve(overrides: list[str]) -> DictConfig:
    """Compose and validate the config of one run, `hardware=auto` made concrete."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hardware=")]
    if not chosen or chosen[-1] == "auto":
        overrides = auto_overrides(overrides)
        auto = True
    else:
        auto = False
    pre = list(overrides)
    strategy = [o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")]
    if strategy and strategy[-1] == "single" and not user_set(overrides, "hardware.devices"):
        pre = [*overrides, "hardware.devices=1"]
    cfg = validate(compose(pre))
    if auto:
        cfg.hardware.resolved_from = "auto"
    return cfg


def _plan(cfg: DictConfig, show: bool) -> dict:
    from loom.plan import make_plan, render

    plan = make_plan(cfg)
    if show or not plan["fits"]:
        render(plan)
    return plan


def _infeasible(plan: dict) -> int:
    mem = plan["memory_per_device_bytes"]
    hint = (f" strategy={plan['suggestion']} would fit." if plan["suggestion"]
            else " No strategy fits: use more devices or a smaller model.")
    print(
        f"Plan infeasible: strategy={plan['strategy']} needs {mem['total'] / 1e9:,.1f} GB per device "
        f"but hardware={plan['hardware']} has {plan['capacity_per_device_bytes'] / 1e9:,.1f} GB "
        f"({plan['capacity_source']}).{hint}",
        file=sys.stderr,
    )
    return EXIT_INFEASIBLE


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = resolve(args.overrides)
    plan = _plan(cfg, show=True)
    return EXIT_OK if plan["fits"] else _infeasible(plan)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = resolve(args.overrides)
    if args.cfg:
        print(OmegaConf.to_yaml(cfg, resolve=True), end="")
        return EXIT_OK
    check_machine(cfg)
    plan = _plan(cfg, show=False)
    if not plan["fits"]:
        return _infeasible(plan)

    from loom.rundir import freeze

    frozen = freeze(cfg, plan)
    if frozen.state == "completed":
        print(f"Run {frozen.run_id} already completed: {frozen.run_dir}\n"
              "Nothing to do. Change an override or set run.id=<new id> to train a new run.")
        return EXIT_OK
    verb = "Resuming" if frozen.state == "resume" else "Starting"
    print(f"{verb} run {frozen.run_id} in {frozen.run_dir}", flush=True)

    from loom.launch import launch

    cfg.run.id = frozen.run_id
    rc = launch(cfg, frozen.run_dir)
    return _finish(cfg, frozen.run_dir, rc)


def _finish(cfg: DictConfig, run_dir: Path, rc: int) -> int:
    from loom.console import print_summary
    from loom.tracking.summary import empty_summary, read_summary, write_summary

    summary = read_summary(run_dir)
    if rc != 0 and (summary is None or summary.get("status") == "completed"):
        # The workers died before rank 0 could write it: record the failure here.
        summary = empty_summary(cfg, str(cfg.run.id))
        write_summary(run_dir, summary)
    if summary is not None:
        print_summary(run_dir, summary)
    print(f"run dir: {run_dir}")
    if rc != 0 or summary is None or summary["status"] != "completed":
        print(f"Training failed (exit {rc}); see {run_dir / 'logs'}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom", description="Declarative distributed training.")
    sub = p.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train", help="compose, validate, plan, freeze and launch a run")
    t.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    t.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option")
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plan", help="world size, batch math, memory per device, fits or not")
    pl.add_argument("overrides", nargs="*")
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage errors are exit 2 already
        return int(e.code or 0)
    try:
        return args.func(args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
