"""Shared helpers: run the real `loom` CLI in a subprocess against a temporary run root, count
every training launch (tests/launches.py, tests/budget.toml), and share reference runs.

Launches are the suite's cost. A behaviour is checked on a shared run where one fits: the
registry `shared.get(*args)` starts each distinct argument list once per session (`PARITY`
runs: the `single` reference at GLOBAL_BATCH is one run used by every parity test). A refusal
is checked in-process (`refused`), not by a launch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from launches import (  # noqa: F401  (pytest hooks: the budgets of launches and seconds)
    LEDGER,
    launching_fixture,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

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


# The environment pytest started with: an in-process Lightning Trainer sets OMP_NUM_THREADS in
# this process (lightning_fabric's _set_num_threads_if_needed: every core), and a launched run
# inheriting it gives each rank that many threads, which changes CPU sums: the SIGKILL resume of
# test_nd, launched after such a test, ended ~1e-6 off its reference launched before it.
_STARTED_WITH_THREADS = os.environ.get("OMP_NUM_THREADS")


def launch_env(env: dict | None = None) -> dict[str, str]:
    """What a launched `loom` gets: this environment, as a fresh shell would have it."""
    full = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    if _STARTED_WITH_THREADS is None:
        full.pop("OMP_NUM_THREADS", None)
    else:
        full["OMP_NUM_THREADS"] = _STARTED_WITH_THREADS
    return {**full, **(env or {})}


def run_loom(*args: str, root: Path, timeout: float = 900, env: dict | None = None) -> LoomResult:
    """`loom <args> run.root=<root>`; finds the run dir from the launcher's output."""
    full_env = launch_env(env)
    verb, *rest = args
    cmd = [*LOOM, verb, *rest]
    if verb in ("train", "plan") and "--cfg" not in rest:
        cmd.append(f"run.root={root}")
    started = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=root)
    run_dirs = [Path(line[len("run dir: "):].strip()) for line in p.stdout.splitlines()
                if line.startswith("run dir: ")]
    if verb == "train":  # each launched run (a sweep's trials too) prints its run dir once, at the end;
        # a SLURM submission prints one too but trains nothing here (a shimmed job: count_launch)
        submitted = sum(line.startswith(("submit it with: ", "Submitted run ")) for line in p.stdout.splitlines())
        LEDGER.record(len(run_dirs) - submitted, time.monotonic() - started, tuple(rest))
    return LoomResult(p.returncode, p.stdout, p.stderr, run_dirs[-1] if run_dirs else None)


def worker_pids(run_dir: Path) -> list[int]:
    """The live rank processes of a run, by rank: each rank's latest "rank N (pid P) started"
    line in logs/rank-N.log (ranks are forked from the agent's forkserver, so no command line
    names the run)."""
    pids: dict[int, int] = {}
    for log in (run_dir / "logs").glob("rank-*.log"):
        started = re.findall(r"\] loom INFO: rank (\d+) \(pid (\d+)\) started", log.read_text(errors="replace"))
        if started:
            rank, pid = map(int, started[-1])
            if alive(pid):
                pids[rank] = pid
    return [pids[r] for r in sorted(pids)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def count_launch() -> None:
    """A training run started by other means than run_loom / start_loom (a shimmed SLURM job)."""
    LEDGER.record(1)


def start_loom(*args: str, root: Path, env: dict | None = None, merge_stderr: bool = True,
               **popen: object) -> subprocess.Popen:
    """`loom <args> run.root=<root>` in the background (output merged into stdout unless
    `merge_stderr` is false), to kill or signal part-way. Counted as one launch."""
    full_env = launch_env(env)
    verb, *rest = args
    LEDGER.record(1)
    return subprocess.Popen([*LOOM, verb, *rest, f"run.root={root}"], cwd=root, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            **popen)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until `path` exists (a checkpoint, say), failing if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited early: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def kill_one_worker_after(proc: subprocess.Popen, run_dir: Path, step: int, ranks: int,
                          timeout: float = 180) -> LoomResult:
    """Once the step-`step` checkpoint exists, SIGKILL the last of the run's `ranks` workers and
    wait for the launcher: its exit code and merged output (what follows is the caller's)."""
    import signal

    wait_for(run_dir / "checkpoints" / f"step-{step:07d}.ckpt", proc, timeout)
    victims = worker_pids(run_dir)
    assert len(victims) == ranks
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=timeout)
    return LoomResult(proc.returncode, out, "", run_dir)


def sigkill_one_worker_after(proc: subprocess.Popen, run_dir: Path, step: int, ranks: int,
                             timeout: float = 180) -> LoomResult:
    """kill_one_worker_after, where torchrun restarts them all and the run must complete having
    resumed from `step` or later."""
    r = kill_one_worker_after(proc, run_dir, step, ranks, timeout)
    assert r.rc == 0, r.out
    s = r.summary()
    assert s["status"] == "completed" and s["restarts"] == 1
    assert s["resumed_from_step"] is not None and s["resumed_from_step"] >= step
    # one line of Loom's says which rank died, how, and where the ranks resume
    said = re.search(r"loom: local rank (\d+) \(pid \d+\) was killed by SIGKILL: torchrun restarts this node's "
                     r"ranks \(1 of \d+ restarts left\); they resume from (\S+)", r.out)
    assert said and int(said[1]) == ranks - 1 and re.search(r"/checkpoints/step-\d{7}\.ckpt$", said[2]), r.out
    # the totals cover both attempts: the killed one's span (to its last log step) counts
    killed, restarted = s["attempts"]
    assert killed["end_step"] >= step and killed["train_s"] > 0 and restarted["start_step"] == s["resumed_from_step"]
    assert s["train_time_s"] == pytest.approx(killed["train_s"] + restarted["train_s"], abs=0.002)
    assert s["steps_trained"] == killed["end_step"] + s["global_step"] - restarted["start_step"]
    return r


# ----------------------------------------------------------------------------- shared runs


class SharedRuns:
    """Session-wide registry of training runs keyed by their arguments: the first test asking for
    an argument list launches it, every later one reads the same result."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[tuple, LoomResult] = {}

    def get(self, *args: str, env: dict | None = None, timeout: float = 900) -> LoomResult:
        key = (args, tuple(sorted((env or {}).items())))
        if key not in self.runs:
            root = self.root / f"run-{len(self.runs):03d}"
            root.mkdir()
            self.runs[key] = run_loom("train", *args, root=root, timeout=timeout, env=env)
        return self.runs[key]


@launching_fixture(scope="session")
def shared(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("shared"))


# Parity runs: every strategy against `single` at the same global batch of GLOBAL_BATCH samples
# (gpt_tiny, fp32, 10 steps). A strategy's micro batch is GLOBAL_BATCH / its data-parallel degree.
STEPS = 10
GLOBAL_BATCH = 8
B = 4  # micro batch of a 2-way data-parallel run
PARITY = [*FAST, "hardware=cpu", "model=gpt_tiny", f"trainer.max_steps={STEPS}", "dataset.seq_len=64"]
# Each parity run also carries a README option whose effect its own checks assert (test_strategies):
# ddp all-reduces bf16-compressed gradients (bf16_compress: ~4e-3 relative rounding per element,
# which Adam's normalized step turns into curve differences far below 1e-3); fsdp keeps the
# gathered parameters from forward to backward (reshard_after_forward=false: the same values, one
# all-gather fewer); zero3 recomputes its blocks' activations (activation checkpointing: the same
# math) and exports bf16 final weights; zero3_offload also offloads its parameter partitions.
# fsdp_tp and zero3 also score `tinycode_mc` in the loop at steps 5 and 10 (rank 0 gathers the sharded
# weights into a whole copy; tests/test_eval_loop.py), which their parity with `single` holds unchanged.
LOOP_EVAL = ["eval.tasks=[tinycode_mc]", "eval.every_n_steps=5", "eval.limit=8"]
PROCS = {"fsdp_tp": ["hardware.devices=4", "strategy.tensor_parallel=2", *LOOP_EVAL],
         "ddp": ["strategy.comm_hook=bf16_compress"],
         "fsdp": ["strategy.reshard_after_forward=false"],
         "zero3": ["trainer.activation_checkpointing=full", "checkpoint.export_dtype=bf16", *LOOP_EVAL],
         "zero3_offload": ["strategy.offload_params=true"],
         "zero1": ["tracking.stragglers=false"]}  # its check: tests/test_stragglers.py
STRATEGIES = ["ddp", "fsdp", "fsdp_tp", "zero1", "zero2", "zero3", "zero3_offload"]
COMMON = [*PARITY, f"dataset.batch_size={B}"]  # a 2-way data-parallel parity run, less its strategy
SINGLE = ("strategy=single", "hardware.devices=1", *PARITY, f"dataset.batch_size={GLOBAL_BATCH}")


def _key(arg: str) -> str:
    return arg.split("=", 1)[0]


def strategy_args(strategy: str, *extra: str) -> tuple[str, ...]:
    """The parity run of `strategy` (2 ranks, or 4 for fsdp_tp's 2 x 2); `extra` overrides add
    to it or replace the parity run's value of the same key (Hydra refuses a key given twice)."""
    base = (f"strategy={strategy}", "hardware.devices=2", *PARITY, f"dataset.batch_size={B}",
            *PROCS.get(strategy, []))
    replaced = {_key(a) for a in extra}
    return (*(a for a in base if _key(a) not in replaced), *extra)


@launching_fixture(scope="session")
def single_run(shared) -> LoomResult:
    """`single` at GLOBAL_BATCH: the reference of every parity test."""
    r = shared.get(*SINGLE)
    assert r.rc == 0, r.out + r.err
    return r


@launching_fixture(scope="session")
def strategy_runs(shared, single_run) -> dict:
    """One launch per strategy (+ the single-process reference), shared by the checks below."""
    out = {"single": single_run}
    for s in STRATEGIES:
        out[s] = shared.get(*strategy_args(s))
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


def refused(root: Path, *args: str) -> str:
    """`loom train <args>` must be refused before anything is written: exit 2, no run dir, no
    traceback. Runs the CLI's own `main` in this process (no subprocess, no launch: a launch
    would fail the test); returns stderr for the message checks. That the CLI answers this way
    without importing torch is tests/test_config.py's (one subprocess per kind of refusal)."""
    from loom import cli, pipeline

    def no_launch(*_a, **_k):
        raise AssertionError(f"not refused: `loom train {' '.join(args)}` reached the launch")

    err = io.StringIO()
    saved, pipeline.launch = pipeline.launch, no_launch
    sys.path.insert(0, str(root))  # as `python -m loom.cli` run in `root` would see it
    try:
        with contextlib.chdir(root), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(["train", *args, f"run.root={root}"])
    finally:
        pipeline.launch = saved
        sys.path.remove(str(root))
    text = err.getvalue()
    assert rc == 2, text
    assert not any(Path(root).rglob("config.yaml")), "a run dir was created"
    assert "Traceback" not in text
    return text


@pytest.fixture
def loom(tmp_path):
    """Call as loom("train", "k=v", ...) -> LoomResult, with runs under tmp_path."""

    def _run(*args: str, timeout: float = 900, env: dict | None = None) -> LoomResult:
        return run_loom(*args, root=tmp_path, timeout=timeout, env=env)

    return _run


@pytest.fixture
def fake_world_of_2():
    """Rank 0 of a 2-rank world on torch's fake process group (collectives return at once): a
    tensor-parallel plan's placements and local shapes, in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def resume_in_process(cfg, run_dir: Path, says: str) -> None:
    """Freeze `cfg` (a resume of `run_dir` at another layout, whose line says `says`) and train it in
    this process as rank 0 of a one-rank world; the default process group fit forms is destroyed after,
    so later in-process tests form their own (the environment it sets: `environment_restored`)."""
    import torch.distributed as dist

    from loom.freeze import freeze
    from loom.plan import make_plan
    from loom.rundir.config_file import load_frozen
    from loom.worker.fit import fit

    frozen = freeze(cfg, make_plan(cfg))
    assert frozen.state == "resume" and says in frozen.message, frozen.message
    try:
        assert fit(load_frozen(run_dir / "config.yaml"), run_dir, 0) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(worker, args: tuple, nprocs: int, out_dir: Path, timeout: float = 600) -> list[dict]:
    """Start `worker(rank, *args)` on `nprocs` spawned processes (a gloo group each forms itself) and
    return what each saved to out_dir/<rank>.pt; a rank's saved traceback, a crash or a hang past
    `timeout` fails the test instead of hanging it."""
    import torch
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.terminate()
                raise AssertionError(f"the {nprocs} ranks did not finish within {timeout} s")
    except mp.ProcessRaisedException as e:
        raise AssertionError(str(e)) from None
    except mp.ProcessExitedException:
        errors = [torch.load(f, weights_only=False).get("traceback") for f in sorted(out_dir.glob("*.pt"))]
        raise AssertionError("\n".join(e for e in errors if e)) from None
    return [torch.load(out_dir / f"{r}.pt", weights_only=False) for r in range(nprocs)]


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it. An in-process `fit` sets MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE (Lightning's environment); inherited by this pytest worker's later subprocesses, they
    sent a launch to the port the in-process store still held (EADDRINUSE in test_elastic, fresh-clone
    .ci/run at a5e40c0) and lm-eval's CLI into torch.distributed ("RANK expected", test_eval)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
