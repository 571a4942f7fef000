"""`loom`: the command line. compose -> validate -> plan -> freeze -> launch -> finish.

Nothing here imports torch or Lightning before the config is valid and the plan feasible:
a bad config is refused within the first second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from loom.config import ConfigError, compose, frozen_container, validate
from loom.hardware import auto_overrides, check_machine, user_set

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INFEASIBLE, EXIT_PREEMPTED = 0, 1, 2, 3, 143


def resolve(overrides: list[str]) -> DictConfig:
    """Compose and validate the config of one run, `hardware=auto` made concrete."""
    from loom import recipes

    overrides, recipe_dirs = recipes.split_searchpath(list(overrides))
    found = recipes.discover(recipe_dirs)
    if recipes.chosen(overrides, found):
        recipes.register(found)
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
    """make_plan; the table when asked (`loom plan`) or when the run cannot fit; warnings
    (e.g. MFU null for a device without a known peak) as one line each on stderr."""
    from loom.plan import make_plan, render

    plan = make_plan(cfg)
    if show or not plan["fits"]:
        render(plan)
    for w in plan.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    return plan


def _infeasible(plan: dict) -> int:
    mem = plan["memory_per_device_bytes"]
    hint = (f" strategy={plan['suggestion']} would fit." if plan["suggestion"]
            else " No strategy fits: use more devices, a smaller model or a smaller dataset.batch_size.")
    if plan.get("max_micro_batch") and plan["max_micro_batch"] < plan["micro_batch"]:
        hint += f" With strategy={plan['strategy']}, dataset.batch_size<={plan['max_micro_batch']} fits."
    cap = plan["capacity_per_device_bytes"]
    if not plan.get("host_memory_ok", True):
        need = f"{mem['host_offload'] / 1e9:,.1f} GB of host memory per device (offload)"
        have = "more host memory than hardware.host_memory_gb allows"
    else:
        need = f"{mem['total'] / 1e9:,.1f} GB per device"
        have = f"{cap / 1e9:,.1f} GB ({plan['capacity_source']})" if cap is not None else "unknown"
    print(
        f"Plan infeasible: strategy={plan['strategy']} needs {need} but hardware={plan['hardware']} "
        f"has {have}.{hint}",
        file=sys.stderr,
    )
    return EXIT_INFEASIBLE


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = resolve(args.overrides)
    plan = _plan(cfg, show=True)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(plan, indent=2) + "\n")
    return EXIT_OK if plan["fits"] else _infeasible(plan)


def cmd_probe(args: argparse.Namespace) -> int:
    """Measure this machine (matmul TFLOP/s, all-reduce bus bandwidth) and write a profile."""
    from loom.probe import probe

    return probe(out=args.out, size=args.size, repeats=args.repeats,
                 allreduce_mb=args.allreduce_mb, processes=args.processes)


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown report (+ plots) of a run dir, or a comparison table of a sweep / several runs."""
    from loom.report import report

    return report(args.paths, out=args.out)


def cmd_train(args: argparse.Namespace) -> int:
    from loom.sweep import split_sweep, translate

    overrides = translate(args.overrides)
    cfg = resolve(split_sweep(overrides)[0] if args.multirun else overrides)
    if args.cfg:
        print(OmegaConf.to_yaml(OmegaConf.create(frozen_container(cfg))), end="")
        return EXIT_OK
    if args.multirun or cfg.sweep.params:
        return _sweep(overrides, cfg, dry_run=args.dry_run)
    rc, _, _ = _train_one(overrides, cfg, dry_run=args.dry_run)
    return rc


def _train_one(overrides: list[str], cfg: DictConfig | None = None,
               dry_run: bool = False) -> tuple[int, Path | None, str | None]:
    """validate -> plan -> freeze -> launch -> finish for one run: (exit code, run dir, error)."""
    from loom.tracking.checks import tracking_checks

    cfg = cfg if cfg is not None else resolve(overrides)
    tracking_checks(cfg)
    check_machine(cfg, dry_run=dry_run)
    plan = _plan(cfg, show=False)
    if not plan["fits"]:
        return _infeasible(plan), None, "plan infeasible"

    from loom.rundir import freeze

    frozen = freeze(cfg, plan)
    if frozen.state == "completed":
        print(f"Run {frozen.run_id} already completed: {frozen.run_dir}\n"
              "Nothing to do. Change an override or set run.id=<new id> to train a new run.")
        return EXIT_OK, frozen.run_dir, None
    from loom.checkpoint import UnsafeCheckpoint, newest_checkpoint

    try:
        newest_checkpoint(frozen.run_dir)
    except UnsafeCheckpoint as e:
        raise ConfigError(str(e)) from None
    if cfg.hardware.launcher == "slurm":  # submitted (exit 0): the job trains later, in the allocation
        from loom.slurm import submit

        cfg.run.id = frozen.run_id
        return submit(cfg, frozen.run_dir, dry_run), frozen.run_dir, None
    verb = "Resuming" if frozen.state == "resume" else "Starting"
    print(f"{verb} run {frozen.run_id} in {frozen.run_dir}", flush=True)

    from loom.launch import launch, summary_mark

    cfg.run.id = frozen.run_id
    mark = summary_mark(frozen.run_dir)  # did rank 0 write summary.json during this launch?
    rc = launch(cfg, frozen.run_dir)
    return _finish(cfg, frozen.run_dir, rc, mark), frozen.run_dir, None


def _sweep(overrides: list[str], base: DictConfig, dry_run: bool = False) -> int:
    """Every trial is a full `_train_one`; a failed trial is recorded and the sweep goes on."""
    from loom.sweep import run_sweep

    def run_trial(trial_overrides: list[str]) -> tuple[int, Path | None, str | None]:
        try:
            return _train_one(trial_overrides, dry_run=dry_run)
        except ConfigError as e:
            print(str(e), file=sys.stderr)
            return EXIT_INVALID, None, str(e)

    sweep_dir, manifest = run_sweep(overrides, base, resolve, run_trial)
    done = [t for t in manifest.trials if t.state == "completed"]
    submitted = [t for t in manifest.trials if t.state == "submitted"]
    print(f"sweep dir: {sweep_dir} ({len(done)}/{len(manifest.trials)} trials completed)")
    if submitted:
        print(f"{len(submitted)} trial(s) submitted to SLURM; run the same command again to update the "
              f"manifest, and `loom report {sweep_dir}` once the jobs have finished.")
        return EXIT_OK
    if done:
        from loom.report import report

        report([str(sweep_dir)], out=None)
    return EXIT_OK if len(done) == len(manifest.trials) else EXIT_FAILED


def cmd_recipes(args: argparse.Namespace) -> int:
    from loom import recipes

    _, dirs = recipes.split_searchpath([f"hydra.searchpath={args.searchpath}"] if args.searchpath else [])
    found = recipes.discover(dirs)
    if args.action == "list":
        from rich.console import Console
        from rich.table import Table

        t = Table("recipe", "what it is for", "file")
        for r in found.values():
            t.add_row(r.name, r.description, str(r.path))
        Console().print(t)
        return EXIT_OK
    if not args.name:
        raise ConfigError(f"Usage: loom recipes {args.action} NAME{' DEST' if args.action == 'copy' else ''}")
    recipes.chosen([f"recipe={args.name}"], found)
    recipe = found[args.name]
    if args.action == "show":
        print(f"# {recipe.path}\n{recipe.path.read_text()}")
        cfg = resolve([f"recipe={args.name}", *([f"hydra.searchpath={args.searchpath}"] if args.searchpath else [])])
        print("# resolved config\n" + OmegaConf.to_yaml(OmegaConf.create(frozen_container(cfg))), end="")
        return EXIT_OK
    if not args.dest:
        raise ConfigError("Usage: loom recipes copy NAME DEST [--force]")
    dest = recipes.copy(recipe, Path(args.dest), args.force)
    print(f"wrote {dest}\nrun it with: loom train recipe={dest.stem} hydra.searchpath='[file://{dest.parent}]'")
    return EXIT_OK


def _finish(cfg: DictConfig, run_dir: Path, rc: int, mark: str | None) -> int:
    from loom.console import print_summary
    from loom.launch import settle_summary

    # rank 0's summary, or (the workers died before rank 0 could write one) a `failed` one
    summary = settle_summary(cfg, run_dir, rc, mark)
    if summary is not None:
        print_summary(run_dir, summary)
    print(f"run dir: {run_dir}")
    if summary is not None and summary["status"] == "preempted":
        print("Run preempted: a checkpoint was saved. Run the same command again to resume.", file=sys.stderr)
        return EXIT_PREEMPTED
    if rc != 0 or summary is None or summary["status"] != "completed":
        print(f"Training failed (exit {rc}); see {run_dir / 'logs'}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom", description="Declarative distributed training.")
    sub = p.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train", help="compose, validate, plan, freeze and launch a run")
    t.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    t.add_argument("--dry-run", action="store_true",
                   help="hardware.launcher=slurm: write <run>/slurm/job.sbatch and print the sbatch "
                        "command instead of submitting")
    t.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: every combination (or optuna trial) is a full distributed run")
    t.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option")
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plan", help="world size, batch math, memory per device, fits or not")
    pl.add_argument("--json", metavar="PATH", help="also write the plan as JSON (as plan.json)")
    pl.add_argument("overrides", nargs="*")
    pl.set_defaults(func=cmd_plan)
    pr = sub.add_parser("probe", help="measure this machine and write a hardware profile")
    pr.add_argument("--out", metavar="PATH",
                    help="profile yaml to write (default: conf/hardware/probe_<hostname>.yaml)")
    pr.add_argument("--size", type=int, default=None, help="matmul size n (n x n @ n x n)")
    pr.add_argument("--repeats", type=int, default=5, help="timed matmul repeats (best is kept)")
    pr.add_argument("--allreduce-mb", type=float, default=32.0, help="all-reduce message size, MB")
    pr.add_argument("--processes", type=int, default=None,
                    help="all-reduce ranks (default: 2 on CPU, every GPU on GPU)")
    pr.set_defaults(func=cmd_probe)
    rp = sub.add_parser("report", help="report.md + plots of a run, or a comparison of a sweep's runs")
    rp.add_argument("paths", nargs="+", metavar="PATH",
                    help="a run dir, a sweep dir (holding run dirs), or several run dirs")
    rp.add_argument("--out", metavar="DIR",
                    help="where a comparison's report.md and scaling.png go "
                         "(default: the sweep dir, else the first run's parent)")
    rp.set_defaults(func=cmd_report)
    rc = sub.add_parser("recipes", help="list, show or copy reusable recipe templates")
    rc.add_argument("action", choices=["list", "show", "copy"])
    rc.add_argument("name", nargs="?")
    rc.add_argument("dest", nargs="?")
    rc.add_argument("--force", action="store_true", help="copy: overwrite DEST")
    rc.add_argument("--searchpath", help="also read recipes from these dirs: '[file://./my-recipes]'")
    rc.set_defaults(func=cmd_recipes)
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
