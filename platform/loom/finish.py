"""Stage 7, finish: once a launch's ranks have exited, settle summary.json, print it, and map
it to the exit code. One path for every launcher: torchrun, the in-process single-device run
and the SLURM job (`python -m loom.finish mark|finish RUN_DIR`, the job script's helpers, no
torch imported)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom import strategies
from loom.errors import EXIT_FAILED, EXIT_INVALID, EXIT_OK, EXIT_PREEMPTED
from loom.launch import multi_node
from loom.rundir import checkpoints
from loom.rundir.config_file import load_frozen
from loom.rundir.failures import failure_paragraph, read_failures, root_failure, summary_error
from loom.rundir.paths import RunDir
from loom.rundir.summary import empty_summary, read_summary, summary_mark, write_summary
from loom.rundir.world_history import TIME_PARTS, read_history, run_totals

# The multi-node failure-summary grace: how long a launcher whose ranks failed waits for global
# rank 0 (perhaps on another node, still in its `finally`) to write summary.json itself.
SUMMARY_GRACE_S = 10.0


def launch_mark(run_dir: Path) -> str:
    """Taken before the ranks start: summary.json's fingerprint and the launcher's clock, so
    `finish` knows whether rank 0 wrote a summary, and which failure records are this launch's."""
    return f"{summary_mark(run_dir) or 'none'}@{time.time():.3f}"  # no leading '-': an argparse value


def _parse_mark(mark: str | None) -> tuple[str | None, float | None]:
    """(summary fingerprint, launch time) of a `launch_mark` (a bare fingerprint: no time)."""
    if not mark or mark == "-":
        return None, None
    sha, _, since = mark.partition("@")
    return (None if sha in ("", "-", "none") else sha), (float(since) if since else None)


def settle_summary(cfg: DictConfig, run_dir: Path, rc: int, mark: str | None,
                   wait_for_rank0: bool) -> dict | None:
    """The run's summary once this launch's ranks exited (`mark`: `launch_mark` before launch).

    Rank 0's, when it wrote one during the launch (summary.json changed since `mark`); else, if
    the ranks failed, a `failed` one written here. Multi-node, global rank 0 may run on another
    node and still be in its `finally`: wait up to SUMMARY_GRACE_S for it before writing, so a
    node without rank 0 does not replace a good (e.g. `preempted`) summary with `failed`. A
    failed run's summary gets `error` from the ranks' failure records (loom.rundir.failures);
    ranks that failed deterministically exit 0 (no torchrun restart), so records count as a
    failure whatever `rc` says.
    """
    before, since = _parse_mark(mark)
    failures = read_failures(run_dir, since)
    if rc != 0 or failures:
        deadline = time.monotonic() + (SUMMARY_GRACE_S if wait_for_rank0 else 0.0)
        while summary_mark(run_dir) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        if summary_mark(run_dir) == before:
            # The workers died before rank 0 could write it: record the failure here.
            empty = empty_summary(cfg, str(cfg.run.id), strategies.layout_of(cfg))
            history = read_history(run_dir)
            empty["world_history"] = empty["attempts"] = history
            total = run_totals(history)  # what the attempts' spans recorded before they died
            empty.update(steps_trained=total["steps"], samples=total["samples"], tokens=total["tokens"],
                         train_time_s=total["train_s"], wall_time_s=total["wall_s"] or None,
                         time={k: total[k] for k in (*TIME_PARTS, "wall_s")})
            write_summary(run_dir, empty)
    summary = read_summary(run_dir)
    if summary is not None and failures and summary["status"] == "failed" and not summary.get("error"):
        summary["error"] = summary_error(root_failure(failures))
        write_summary(run_dir, summary)
    return summary


def finish(cfg: DictConfig, run_dir: Path, rc: int, mark: str | None, *, in_job: bool = False) -> int:
    """Settle, print and map the run's outcome: 0 completed, 143 preempted, 1 otherwise.

    `in_job`: after srun in a SLURM job, every node's ranks have exited already (no wait for
    rank 0), and a preemption without progress since the attempt started is a failure, so the
    job script does not requeue a run that cannot move forward."""
    summary = settle_summary(cfg, run_dir, rc, mark, wait_for_rank0=multi_node(cfg) and not in_job)
    if summary is not None:
        print_summary(run_dir, summary)
    print(f"run dir: {run_dir}", flush=True)
    status = summary["status"] if summary else None
    if status == "preempted":
        start, step = summary.get("resumed_from_step"), summary.get("global_step", 0)
        if in_job and start is not None and step <= start:
            print(f"loom: preempted at step {step} without progress since the last start: not requeueing",
                  file=sys.stderr)
            return EXIT_FAILED
        if not in_job:
            print(f"Run stopped at step {step}: a checkpoint was saved ({checkpoints.step_path(run_dir, step)}).\n"
                  "Run the same command again to resume.", file=sys.stderr)
        return EXIT_PREEMPTED
    if rc != 0 or status != "completed":
        print(_failure_message(run_dir, rc, summary), file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _failure_message(run_dir: Path, rc: int, summary: dict | None) -> str:
    """One paragraph: the root failure's record, or (no rank recorded one) where to look."""
    error = (summary or {}).get("error")
    if error:
        records = [r for r in read_failures(run_dir, None) if r.get("rank") == error.get("rank")]
        return failure_paragraph(records[0] if records else error)
    from loom.launch.console import agent_log

    return (f"Training failed (exit {rc}) without a rank recording an error (killed, or out of memory?); "
            f"see {RunDir(run_dir).logs} ({RunDir(run_dir).log('N').name}, and {agent_log(run_dir).name}: the torchrun "
            "agent's output).")


def _fmt(v: Any, spec: str = ",.1f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def world_history_text(history: list[dict[str, Any]]) -> str:
    """The attempts of a run that restarted or changed its world, in one row: on an elastic run's
    surviving node the only sign at the end that a node was lost and training went on without it."""
    return ", ".join(f"{h.get('world_size')} rank(s) from step {h.get('start_step')} ({h.get('reason')})"
                     for h in history)


def steps_text(s: dict[str, Any]) -> str:
    """The run's last step and what it trained; steps trained again after a restart are said."""
    text = f"{s['global_step']:,} ({s['tokens']:,} tokens, {s['samples']:,} samples trained)"
    trained, attempts = s.get("steps_trained"), len(s.get("attempts") or [])
    if trained and trained != s["global_step"] and attempts > 1:
        text += f"; {trained:,} steps trained over {attempts} attempts"
    return text


def rate_text(tp: dict[str, Any], key: str, spec: str) -> str:
    """`steady (from step N); overall` (summary.json `throughput` and `throughput.overall`)."""
    overall = (tp.get("overall") or {}).get(key)
    if not tp.get("steady"):
        return f"{_fmt(tp[key], spec)} overall (no steady window: the run ended in its first logged window)"
    return f"{_fmt(tp[key], spec)} steady (from step {tp.get('steady_from_step')}); {_fmt(overall, spec)} overall"


def time_text(s: dict[str, Any]) -> str:
    """Training time with what it holds (compile, first step), and what is not training."""
    t = s.get("time") or {}
    inside = [f"{label} {_fmt(t.get(k), ',.1f', ' s')}" for k, label in
              (("compile_s", "compile"), ("first_step_s", "first step")) if t.get(k)]
    text = f"{_fmt(s['train_time_s'], ',.1f', ' s')} training" + (f" ({', '.join(inside)})" if inside else "")
    for key, label in (("validation_s", "validation"), ("checkpoint_s", "checkpoints"), ("eval_s", "evaluation")):
        if t.get(key):
            text += f", {_fmt(t[key], ',.1f', ' s')} {label}"
    return text + f", {_fmt(s['wall_time_s'], ',.1f', ' s')} wall"


def print_summary(run_dir: Path, s: dict[str, Any]) -> None:
    """The one-screen summary the launcher prints at the end of `loom train`."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from loom.rundir.summary import validation_text

    t = Table(title=f"loom run {s['run_id']}: {s['status']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    tp, mem = s["throughput"], s["memory"]
    peak_rss = max(mem["peak_rss_gb_per_rank"]) if mem.get("peak_rss_gb_per_rank") else None
    rows = [
        ("run dir", str(run_dir)),
        ("strategy / hardware", f"{s['strategy']} on {s['hardware']}, world size {s['world_size']} "
                                f"({s['num_nodes']} node(s))"),
        ("steps", steps_text(s)),
        ("loss", f"{_fmt(s.get('first_loss'), '.4f')} -> {_fmt(s['final_loss'], '.4f')}"),
        ("validation", validation_text(s.get("validation"))),
        *([("tokens/s", rate_text(tp, "tokens_per_sec", ",.0f"))] if tp["tokens_per_sec"] is not None else []),
        ("samples/s", rate_text(tp, "samples_per_sec", ",.1f")),
        ("MFU", _fmt(tp["mfu"], ".1%") if tp["mfu"] is not None else "n/a (device peak unknown)"),
        ("peak memory", f"{_fmt(peak_rss, '.2f', ' GB')} RSS per rank (max)"),
        ("time", time_text(s)),
    ]
    if s.get("error"):
        e = s["error"]
        rows.append(("error", f"{e['type']}: {e['message']} (rank {e['rank']}, step {e['step']}; {e['log']})"))
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from", f"step {s['resumed_from_step']}"))
    if len(s.get("world_history") or []) > 1:
        rows.append(("world history", world_history_text(s["world_history"])))
    if s.get("final_weights"):
        rows.append(("final weights", str(run_dir / s["final_weights"])))
    for k, v in rows:
        t.add_row(k, Text(v))  # plain text: an error message's "[...]" is not rich markup
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    """The SLURM job script's helpers: `mark` before srun, `finish` after it."""
    p = argparse.ArgumentParser(prog="python -m loom.finish", description="helpers of Loom's SLURM job script")
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("mark", help="print summary.json's fingerprint before the ranks start")
    m.add_argument("run_dir")
    f = sub.add_parser("finish", help="settle summary.json after srun; exit 0 | 143 (requeue) | 1")
    f.add_argument("run_dir")
    f.add_argument("--rc", type=int, required=True)
    f.add_argument("--mark", default="-")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) and EXIT_INVALID
    if args.verb == "mark":
        print(launch_mark(Path(args.run_dir)))
        return EXIT_OK
    run_dir = Path(args.run_dir).resolve()
    cfg = load_frozen(RunDir(run_dir).config)
    return finish(cfg, run_dir, args.rc, None if args.mark == "-" else args.mark, in_job=True)


if __name__ == "__main__":
    sys.exit(main())
