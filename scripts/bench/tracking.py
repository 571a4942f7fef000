#!/usr/bin/env python
"""What tracking costs per training step: tracking=offline (wandb offline + CSV) vs tracking=none.

Runs `loom train strategy=single hardware.devices=1` with each setting, interleaved
(A B A B ...) so that drift in the machine's load hits both alike, and prints the median
per-step time of each and their ratio. The per-step time is the summary's train_time_s /
steps: the training loop's own time (start-up, wandb init and the end-of-run validation
are outside it), so only what tracking adds inside the loop is compared. Median wall time
(start-up included) is printed too. Nothing asserts a time.

    .venv/bin/python scripts/bench/tracking.py [--repeats 3] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("offline", "none")


def one_run(mode: str, i: int, args: argparse.Namespace, root: Path) -> dict:
    cmd = [
        sys.executable, "-m", "loom.cli", "train", "strategy=single", "hardware.devices=1",
        f"tracking={mode}", f"trainer.max_steps={args.steps}", f"trainer.log_every_n_steps={args.log_every}",
        "checkpoint.every_n_steps=0", "trainer.limit_val_batches=1", f"dataset.max_bytes={args.max_bytes}",
        f"model={args.model}", f"run.id=bench-{mode}-{i}", f"run.root={root}", *args.overrides,
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    summary = json.loads((root / "gpt" / f"bench-{mode}-{i}" / "summary.json").read_text())
    steps = summary["global_step"]
    return {
        "mode": mode,
        "repeat": i,
        "steps": steps,
        "train_time_s": summary["train_time_s"],
        "step_time_ms": 1000 * summary["train_time_s"] / steps,
        "tokens_per_sec": summary["throughput"]["tokens_per_sec"],
        "wall_time_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting (default 3)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    ap.add_argument("--log-every", type=int, default=10, help="trainer.log_every_n_steps (default 10)")
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="dataset.max_bytes")
    ap.add_argument("--root", type=Path, help="run root (default: a temporary dir, removed afterwards)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args(argv)

    root = args.root or Path(tempfile.mkdtemp(prefix="loom-bench-tracking-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    try:
        for i in range(args.repeats):
            for mode in MODES:  # interleaved: offline none offline none ...
                r = one_run(mode, i, args, root)
                runs.append(r)
                print(f"  tracking={mode:<8} repeat {i}: {r['step_time_ms']:7.1f} ms/step  "
                      f"{r['tokens_per_sec']:9,.0f} tok/s  wall {r['wall_time_s']:5.1f} s", flush=True)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)

    med = {m: statistics.median(r["step_time_ms"] for r in runs if r["mode"] == m) for m in MODES}
    wall = {m: statistics.median(r["wall_time_s"] for r in runs if r["mode"] == m) for m in MODES}
    ratio = med["offline"] / med["none"]
    print(f"median step time: tracking=offline {med['offline']:.1f} ms, tracking=none {med['none']:.1f} ms, "
          f"ratio offline/none {ratio:.3f}")
    print(f"median wall time: tracking=offline {wall['offline']:.1f} s, tracking=none {wall['none']:.1f} s "
          f"(start-up and wandb init included)")
    if args.json:
        args.json.write_text(json.dumps({
            "config": {"repeats": args.repeats, "steps": args.steps, "log_every_n_steps": args.log_every,
                       "model": args.model, "overrides": args.overrides},
            "median_step_time_ms": med, "median_wall_time_s": wall, "ratio_offline_over_none": ratio,
            "runs": runs,
        }, indent=2) + "\n")
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
