"""`loom`: the command line. Each verb parses its arguments and hands over to a stage:
`train` to the pipeline (or a sweep of pipelines), `plan` to the plan, `report`, `probe`,
`export`, `generate`, `eval`, `recipes` and `data` to their modules.

Nothing here imports torch or Lightning before the config is valid and the plan feasible:
a bad config is refused within the first second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import DictConfig

from loom import errors
from loom.errors import EXIT_FAILED, EXIT_INFEASIBLE, EXIT_INVALID, EXIT_OK, ConfigError, PlanInfeasible
from loom.pipeline import plan_run, refuse_infeasible, resolve, train_one
from loom.rundir.config_file import frozen_yaml


def cmd_plan(args: argparse.Namespace) -> int:
    from loom.sweep import translate

    if args.compare:
        return _compare(translate(args.overrides), args.json, args.rehearse)
    overrides = translate(args.overrides)
    cfg = resolve(overrides)
    plan = plan_run(cfg, show=True, overrides=overrides)
    data, rc = plan.to_dict(), EXIT_OK
    if args.rehearse:  # loom.rehearse: build and step ranks of this layout over a fake process group
        from loom.rehearse import rehearse_into

        rc = rehearse_into(cfg, data, args.rank)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return rc if rc != EXIT_OK else (EXIT_OK if plan.fits else refuse_infeasible(plan))


def _compare(overrides: list[str], json_path: str | None, rehearse: bool = False) -> int:
    """`loom plan --compare`: every valid layout of the world, best first (torch-free);
    `--rehearse`: the top three rehearsed and re-ranked by their rehearsed peaks."""
    from loom.compose import compose
    from loom.plan.compare import compare, render_comparison

    cfg = compose(overrides)
    result = compare(cfg)
    render_comparison(result, cfg.hardware.name, cfg.model.name)
    rows = [c.to_dict() for c in result.candidates]
    if rehearse:
        from loom.rehearse.compare import rehearse_top

        rows = rehearse_top(result.candidates)
    if json_path:
        import json

        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return EXIT_OK


def cmd_probe(args: argparse.Namespace) -> int:
    """Measure this machine (matmul TFLOP/s, all-reduce bus bandwidth) and write a profile."""
    from loom.probe import probe

    return probe(out=args.out, size=args.size, repeats=args.repeats,
                 allreduce_mb=args.allreduce_mb, processes=args.processes)


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown report (+ plots) of a run dir, or a comparison table of a sweep / several runs."""
    from loom.report import report

    return report(args.paths, out=args.out, objective=args.objective, direction=args.direction)


def cmd_export(args: argparse.Namespace) -> int:
    """A finished or checkpointed run's weights as Loom's model.safetensors, a Hugging Face
    directory or a LoRA run's peft adapter, without training (torch only once the request is valid)."""
    from loom.export import export

    return export(args.run_dir, args.format, out=args.out, step=args.step, dtype=args.dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    """Text from a run's weights through their Hugging Face export and transformers' generate
    (torch is imported only once the request is valid)."""
    from loom.generate import Settings, generate

    settings = Settings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    return generate(args.run_dir, args.prompt, args.chat, step=args.step, settings=settings)


def cmd_eval(args: argparse.Namespace) -> int:
    """A run's weights scored on benchmark tasks by lm-evaluation-harness (torch and lm_eval are
    imported only once the request is valid)."""
    from loom.evaluate import evaluate_run

    return evaluate_run(args.run_dir, args.tasks.split(","), step=args.step, limit=args.limit,
                        num_fewshot=args.num_fewshot, batch_size=args.batch_size)


def cmd_data(args: argparse.Namespace) -> int:
    """`loom data prepare` / `loom data inspect`: token stores (torch is never imported)."""
    from loom.data.prepare.command import inspect_command, prepare_command

    return prepare_command(args) if args.action == "prepare" else inspect_command(args)


def cmd_train(args: argparse.Namespace) -> int:
    from loom.sweep import split_sweep, translate

    if args.help or args.info:
        from loom.compose.help import info_text, train_help

        print(train_help(args.parser.format_help(), args.overrides) if args.help else info_text(args.overrides))
        return EXIT_OK
    overrides = translate(args.overrides)
    cfg = resolve(split_sweep(overrides)[0] if args.multirun else overrides)
    if args.cfg:
        print(frozen_yaml(cfg), end="")
        return EXIT_OK
    if args.dry_run and cfg.hardware.launcher not in ("slurm", "kubernetes"):
        raise ConfigError(
            f"Invalid usage: --dry-run writes the sbatch script or the TrainJob of a hardware.launcher=slurm "
            f"or kubernetes run, but "
            f"hardware={cfg.hardware.name} runs here (hardware.launcher={cfg.hardware.launcher}): it would "
            "train for real. Drop --dry-run, or use `loom plan ...` to see the plan without training, or "
            "`loom train --cfg job ...` for the composed config.")
    if args.multirun or cfg.sweep.params:
        return _sweep(overrides, cfg, dry_run=args.dry_run)
    rc, _, _ = train_one(overrides, cfg, dry_run=args.dry_run)
    return rc


def _sweep(overrides: list[str], base: DictConfig, dry_run: bool = False) -> int:
    """Every trial is a full `train_one`; a failed trial is recorded and the sweep goes on."""
    from loom.sweep import run_sweep

    def run_trial(trial_overrides: list[str]) -> tuple[int, Path | None, str | None]:
        try:
            return train_one(trial_overrides, dry_run=dry_run)
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
    if dry_run:
        print("--dry-run: the sbatch script of every trial is written; nothing was submitted (the manifest "
              "keeps those trials pending). Run the same command without --dry-run to submit them.")
        return EXIT_OK
    if done:
        from loom.report import report

        report([str(sweep_dir)], out=None)
    return EXIT_OK if len(done) == len(manifest.trials) else EXIT_FAILED


def cmd_recipes(args: argparse.Namespace) -> int:
    from loom.compose import recipes

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
        print("# resolved config\n" + frozen_yaml(cfg), end="")
        return EXIT_OK
    if not args.dest:
        raise ConfigError("Usage: loom recipes copy NAME DEST [--force]")
    dest = recipes.copy(recipe, Path(args.dest), args.force)
    print(f"wrote {dest}\nrun it with: loom train recipe={dest.stem} hydra.searchpath='[file://{dest.parent}]'")
    return EXIT_OK


def versions_text() -> str:
    """Loom's, Python's, torch's, CUDA's and NCCL's versions: what a site's own torch build is
    (an air-gapped GPU node's). torch is imported for this only."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        loom = version("loom")
    except PackageNotFoundError:
        loom = "unknown (not installed as a package)"
    lines = [f"loom {loom}", f"python {sys.version.split()[0]}"]
    try:
        import torch
    except ImportError:
        return "\n".join([*lines, "torch not installed"])
    nccl = "none"
    if torch.version.cuda:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # a CUDA build without NCCL, or no driver to ask
            nccl = f"unknown ({type(e).__name__})"
    return "\n".join([*lines, f"torch {torch.__version__}", f"cuda {torch.version.cuda or 'none (a CPU build)'}",
                      f"nccl {nccl}"])


class _PrintVersions(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(versions_text())
        parser.exit()


def _data_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="prepare a token store from text (all cores, resumable) or inspect one")
    dsub = d.add_subparsers(dest="action", required=True)
    pp = dsub.add_parser("prepare", help="tokenize files, JSONL/CSV/parquet (.gz/.zst) or a saved HF dataset "
                                         "into a Megatron-format token store")
    pp.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="files or quoted globs ('**' recurses): text (one document per file), .jsonl/.json, "
                         ".csv, .parquet, each optionally .gz/.zst; or a save_to_disk directory")
    pp.add_argument("--out", required=True, metavar="DIR", help="the store directory or URL (s3://bucket/key): "
                                                                  "new, or an interrupted prepare to resume")
    pp.add_argument("--tokenizer", metavar="NAME_OR_DIR",
                    help="a local Hugging Face tokenizer directory or a cached name (default: byte-level)")
    pp.add_argument("--field", default="text", help="the text field/column of JSONL, CSV, parquet and "
                                                    "datasets inputs (default: text)")
    pp.add_argument("--workers", type=int, metavar="N", help="worker processes (default: every core)")
    pp.add_argument("--strict", action="store_true",
                    help="refuse a document that is not UTF-8 (default: count and skip it)")
    pp.add_argument("--shard-mb", type=float, metavar="MB",
                    help="input per work unit and shard (default: a 64th of the input, 1 to 256); it fixes "
                         "the output, --workers does not")
    pp.add_argument("--max-doc-mb", type=float, metavar="MB", default=None,
                    help="the longest document (M characters) tokenized whole when the tokenizer gives no place "
                         "to cut it into 1 M-character pieces; a longer one is refused, naming it (default: 8)")
    pp.add_argument("--stage", metavar="DIR", help="a URL --out's local folder before upload (default: in the cache)")
    _storage_flags(pp)
    pp.set_defaults(func=cmd_data)
    ins = dsub.add_parser("inspect", help="documents, tokens, tokenizer, shards and sources of a store")
    ins.add_argument("path", metavar="PATH", help="a store directory, a Megatron prefix or an object-store URL")
    _storage_flags(ins)
    ins.set_defaults(func=cmd_data)


def _storage_flags(p: argparse.ArgumentParser) -> None:
    """A URL's endpoint and profile (credentials: only the environment and the provider's files)."""
    p.add_argument("--endpoint-url", metavar="URL", help="an S3-compatible endpoint (default: $AWS_ENDPOINT_URL)")
    p.add_argument("--profile", metavar="NAME", help="a named profile of the provider's credential files")


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="text from a run's final weights or a checkpoint (--prompt, or --chat "
                                        "on stdin), through its Hugging Face export and transformers")
    g.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (`loom train` prints it after 'run dir:')")
    g.add_argument("--prompt", metavar="TEXT", help="the text to continue; the continuation is printed")
    g.add_argument("--chat", action="store_true",
                   help="a conversation: user turns from stdin, one a line (a prompt on a terminal), each reply "
                        "printed; ends at EOF or an empty line. Needs a chat template (the tokenizer's or "
                        "dataset.chat_template)")
    g.add_argument("--step", type=int, metavar="N",
                   help="the checkpoint of step N (default: the final weights of a completed run, else the "
                        "newest checkpoint), as `loom export`")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy (the default); above 0: sampled at that temperature")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sampling: keep the likeliest tokens holding this mass (default 1.0: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling: the random seed (default 0)")
    g.set_defaults(func=cmd_generate)


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="score a run's final weights or a checkpoint on benchmark tasks "
                                    "(lm-evaluation-harness); writes RUN_DIR/eval/step-N.json")
    e.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (`loom train` prints it after 'run dir:')")
    e.add_argument("--tasks", required=True, metavar="A,B",
                   help="lm-eval task names (Loom ships tinycode_mc, tinycode_complete, tinycode_ppl) or "
                        "paths to task YAML files or directories, comma-separated")
    e.add_argument("--step", type=int, metavar="N",
                   help="the checkpoint of step N (default: the final weights of a completed run, else the "
                        "newest checkpoint), as `loom export`")
    e.add_argument("--limit", type=int, metavar="N", help="documents per task (default: the run's eval.limit; all)")
    e.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples (default: each task's own)")
    e.add_argument("--batch-size", type=int, metavar="B", help="requests per forward pass (default: eval.batch_size)")
    e.set_defaults(func=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom", description="Declarative distributed training.")
    p.add_argument("--version", nargs=0, action=_PrintVersions,
                   help="print Loom's, Python's, torch's, CUDA's and NCCL's versions and exit")
    sub = p.add_subparsers(dest="verb", required=True)
    t = sub.add_parser("train", help="compose, validate, plan, freeze and launch a run", add_help=False)
    t.add_argument("-h", "--help", action="store_true",
                   help="show this help, the config groups and their options, and exit")
    t.add_argument("--info", action="store_true",
                   help="print the config search path and the config sources, and exit")
    t.add_argument("--cfg", choices=["job"], help="print the composed config and exit")
    t.add_argument("--dry-run", action="store_true",
                   help="hardware.launcher=slurm: write <run>/slurm/job.sbatch and print the sbatch "
                        "command instead of submitting")
    t.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: every combination (or optuna trial) is a full distributed run")
    t.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option, ~key")
    t.set_defaults(func=cmd_train, parser=t)
    pl = sub.add_parser("plan", help="world size, batch math, memory per device, fits or not")
    pl.add_argument("--json", metavar="PATH", help="also write the plan as JSON (as plan.json)")
    pl.add_argument("--compare", action="store_true",
                    help="list every valid layout of the world (strategy and degrees) with memory, fit "
                         "and predicted step time, best first")
    pl.add_argument("--rehearse", action="store_true",
                    help="build and step ranks of the layout on this machine (fake process group, fake "
                         "tensors, torch's memory tracker) and compare their memory with the plan's")
    pl.add_argument("--rank", metavar="R[,R...]",
                    help="--rehearse: the ranks to rehearse (default: 0 and the fullest pipeline stage's first)")
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
                         "(default: the sweep dir; for run dirs given one by one, the current directory)")
    rp.add_argument("--objective", metavar="METRIC",
                    help="rank a sweep's finished trials by another summary.json metric, without training "
                         "(e.g. throughput.tokens_per_sec, validation.loss)")
    rp.add_argument("--direction", choices=("minimize", "maximize"),
                    help="with --objective (default: maximize a rate or accuracy, minimize a loss or time)")
    rp.set_defaults(func=cmd_report)
    ex = sub.add_parser("export", help="write a finished or checkpointed run's weights (hf | peft | loom) "
                                       "without training")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (`loom train` prints it after 'run dir:')")
    ex.add_argument("--format", required=True, metavar="hf|peft|loom",
                    help="hf: the Hugging Face directory from_pretrained loads (models with a transformers architecture; a "
                         "LoRA run's adapter merged into its base); peft: a LoRA run's adapter directory "
                         "(PeftModel.from_pretrained); loom: model.safetensors as in final/")
    ex.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/export/<format>-step-<N>)")
    ex.add_argument("--step", type=int, metavar="N",
                    help="the checkpoint of step N (default: the final weights of a completed run, else "
                         "the newest checkpoint)")
    ex.add_argument("--dtype", metavar="fp32|bf16|fp16",
                    help="floating tensors' dtype (default: the run's checkpoint.export_dtype)")
    ex.set_defaults(func=cmd_export)
    _generate_parser(sub)
    _eval_parser(sub)
    _data_parser(sub)
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
    except (PlanInfeasible, errors.Unavailable) as e:  # storage down past its retry budget: 1, try again later
        print(str(e), file=sys.stderr)
        return EXIT_INFEASIBLE if isinstance(e, PlanInfeasible) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
