"""Shared helpers: run the real `loom` CLI in a subprocess against a temporary run root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def worker_pids(run_dir: Path) -> list[int]:
    """The rank processes of a run (not torchrun, whose command line also names loom.worker)."""
    out = subprocess.run(["pgrep", "-f", f"loom.worker {run_dir}"], capture_output=True, text=True).stdout
    pids = []
    for pid in out.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" not in cmdline:
            pids.append(int(pid))
    return pids


def start_loom(*args: str, root: Path) -> subprocess.Popen:
    """`loom <args> run.root=<root>` in the background (output merged into stdout), to kill or
    signal part-way."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    verb, *rest = args
    return subprocess.Popen([*LOOM, verb, *rest, f"run.root={root}"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until `path` exists (a checkpoint, say), failing if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited early: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def sigkill_one_worker_after(proc: subprocess.Popen, run_dir: Path, step: int, ranks: int,
                             timeout: float = 180) -> LoomResult:
    """Once the step-`step` checkpoint exists, SIGKILL the last of the run's `ranks` workers;
    torchrun restarts them all and the run must complete having resumed from `step` or later."""
    import signal

    wait_for(run_dir / "checkpoints" / f"step-{step:07d}.ckpt", proc)
    victims = worker_pids(run_dir)
    assert len(victims) == ranks
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    r = LoomResult(0, out, "", run_dir)
    s = r.summary()
    assert s["status"] == "completed" and s["restarts"] == 1
    assert s["resumed_from_step"] is not None and s["resumed_from_step"] >= step
    return r


# One short run of every strategy, shared by tests/test_strategies.py and tests/test_plan.py.
STEPS = 6
B = 4  # micro batch per rank; `single` uses 2B
COMMON = [*FAST, f"trainer.max_steps={STEPS}", f"dataset.batch_size={B}", "dataset.seq_len=64"]
# DDP runs with a gradient-compression hook (fp16 all-reduce): it must register on CPU/gloo
# and its rounding (~1e-3 relative per gradient element) stays within the curve tolerance.
PROCS = {"fsdp_tp": ["hardware.devices=4", "strategy.tensor_parallel=2"],
         "ddp": ["strategy.comm_hook=fp16_compress"]}
STRATEGIES = ["ddp", "fsdp", "fsdp_tp", "zero1", "zero2", "zero3", "zero3_offload"]


@pytest.fixture(scope="session")
def strategy_runs(tmp_path_factory) -> dict:
    """One launch per strategy (+ the single-process reference), shared by the checks below."""
    out = {}
    root = tmp_path_factory.mktemp("strategies")
    t0 = time.time()
    out["single"] = run_loom("train", "strategy=single", *COMMON, f"dataset.batch_size={2 * B}", root=root)
    for s in STRATEGIES:
        out[s] = run_loom("train", f"strategy={s}", *COMMON, *PROCS.get(s, []), root=root)
    print(f"{len(out)} launches in {time.time() - t0:.0f} s")
    return out


def killed_copy(run_dir: Path, root: Path, root2: Path, **summary: object) -> Path:
    """A completed run's dir (under root), copied under root2 and left the way a run killed after its
    last periodic checkpoint is: no final weights, no checkpoint at the final step (completion
    writes one), `last.ckpt` on the newest left, summary.json `failed` (the launcher writes
    that; `summary` updates it further). Resuming it redoes the steps after that checkpoint."""
    import shutil

    from loom.rundir.checkpoints import complete_checkpoints, step_of

    copy = root2 / run_dir.relative_to(root)
    shutil.copytree(run_dir, copy, symlinks=True)
    shutil.rmtree(copy / "final")
    done = json.loads((copy / "summary.json").read_text())
    final = done["global_step"]
    for path in complete_checkpoints(copy):
        if step_of(path) >= final:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    last = copy / "checkpoints" / "last.ckpt"
    last.unlink(missing_ok=True)
    last.symlink_to(complete_checkpoints(copy)[0].name)
    (copy / "summary.json").write_text(json.dumps({**done, "status": "failed", **summary}))
    return copy


def refused_fast(loom, tmp_path: Path, *args: str) -> str:
    """`loom train <args>` must be refused by validation: exit 2 within 3 s (no torch import,
    no process), no run dir, no traceback. Returns stderr for the message checks."""
    t0 = time.monotonic()
    r = loom("train", *args)
    took = time.monotonic() - t0
    assert r.rc == 2, r.out + r.err
    assert took < 3.0, took
    assert not any(tmp_path.rglob("config.yaml")), "a run dir was created"
    assert "Traceback" not in r.err
    return r.err


@pytest.fixture
def loom(tmp_path):
    """Call as loom("train", "k=v", ...) -> LoomResult, with runs under tmp_path."""

    def _run(*args: str, timeout: float = 300, env: dict | None = None) -> LoomResult:
        return run_loom(*args, root=tmp_path, timeout=timeout, env=env)

    return _run
