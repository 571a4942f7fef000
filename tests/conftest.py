"""Shared helpers: run the real `loom` CLI in a subprocess against a temporary run root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOM = [sys.executable, "-m", "loom.cli"]
# Small and fast: a 2 MB slice of the corpus, CSV tracking (no wandb service), few steps.
FAST = ["dataset.max_bytes=2000000", "tracking=csv", "trainer.log_every_n_steps=1",
        "checkpoint.every_n_steps=0"]


@dataclass
class LoomResult:
    rc: int
    out: str
    err: str
    run_dir: Path | None

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def metrics(self) -> list[dict]:
        import csv

        with open(self.run_dir / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))

    def losses(self) -> dict[int, float]:
        """train/loss by step, from metrics.csv."""
        return {int(r["step"]): float(r["train/loss"]) for r in self.metrics() if r.get("train/loss")}


def run_loom(*args: str, root: Path, timeout: float = 300, env: dict | None = None) -> LoomResult:
    """`loom <args> run.root=<root>`; finds the run dir from the launcher's output."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    verb, *rest = args
    cmd = [*LOOM, verb, *rest]
    if verb in ("train", "plan") and "--cfg" not in rest:
        cmd.append(f"run.root={root}")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=root)
    run_dir = None
    for line in p.stdout.splitlines():
        if line.startswith("run dir: "):
            run_dir = Path(line[len("run dir: "):].strip())
    return LoomResult(p.returncode, p.stdout, p.stderr, run_dir)


@pytest.fixture
def loom(tmp_path):
    """Call as loom("train", "k=v", ...) -> LoomResult, with runs under tmp_path."""

    def _run(*args: str, timeout: float = 300, env: dict | None = None) -> LoomResult:
        return run_loom(*args, root=tmp_path, timeout=timeout, env=env)

    return _run
