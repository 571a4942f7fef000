#!/usr/bin/env python
"""How fast the torch-free answers of the CLI come back, as whole processes (interpreter start
included): a refused config, `--help`, `loom plan` and `loom plan --compare`.

The tests check that these answers import no torch (tests/test_config.py); the speed goals
live here, where a loaded machine makes a slow number, not a failed test:
  refusal  <= 1 s      --help  <= 3 s      plan  <= 1.5 s      plan --compare  <= 1.5 s CPU

Each command runs `--repeats` times (default 5), interleaved; the table gives the median wall
time and the median CPU time of the child (user + system), and the goal.

    .venv/bin/python scripts/bench/cli_latency.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time

from _bench import PY, REPO, bench_env, median, write_json

COMMANDS = {
    "refusal (model=nope)": (["train", "model=nope"], 2, 1.0),
    "refusal (hydra.*)": (["train", "hydra.launcher.n_jobs=2"], 2, 1.0),
    "train --help": (["train", "--help"], 0, 3.0),
    "plan 7b zero3 h100x8": (["plan", "model=gpt_7b", "strategy=zero3", "hardware=h100x8"], 0, 1.5),
    "plan --compare 7b h100x8": (["plan", "--compare", "model=gpt_7b", "hardware=h100x8"], 0, 1.5),
}


def timed(args: list[str], rc: int, cwd: str) -> tuple[float, float]:
    """(wall s, child CPU s) of one `python -m loom.cli <args>`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-m", "loom.cli", *args, f"run.root={cwd}/runs"], capture_output=True, text=True,
                       env=bench_env(), cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != rc:
        sys.exit(f"{args}: exit {p.returncode}, expected {rc}\n{p.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(a.repeats):
            for name, (args, rc, _goal) in COMMANDS.items():
                samples[name].append(timed(args, rc, cwd))
    print(f"repo: {REPO}   repeats: {a.repeats}")
    print(f"{'command':28s} {'wall s':>8s} {'cpu s':>8s} {'goal s':>8s}")
    results = {}
    for name, (_args, _rc, goal) in COMMANDS.items():
        wall, cpu = median([w for w, _ in samples[name]]), median([c for _, c in samples[name]])
        results[name] = {"wall_s": wall, "cpu_s": cpu, "goal_s": goal}
        flag = "" if wall <= goal else "  (over goal)"
        print(f"{name:28s} {wall:8.2f} {cpu:8.2f} {goal:8.2f}{flag}")
    if a.json:
        write_json(a.json, results)


if __name__ == "__main__":
    main()
