"""Every path of a run dir and of a sweep dir, named here once (`RunDir`, `SweepDir`).

Stages, reports and renderers ask a `RunDir` for a path instead of joining names by hand, so a
file is renamed in one line and the README's "What a run writes" (`run_dir_table()`) cannot
drift from what is written: each path carries the one line that describes it
(tests/test_rundir_names.py greps the rest of Loom for the names and checks the README).
Import-light on purpose (the standard library only): the CLI's first second and the launcher read it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

STEP_RE = re.compile(r"^step-(\d+)\.ckpt$")   # a complete checkpoint's name (never `.partial`)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


class Part:
    """One fixed path inside a run (or sweep) dir: its relative name and the README's line on it."""

    def __init__(self, rel: str, what: str, shown: str | None = None, row: bool = True) -> None:
        self.rel, self.what, self.row = rel, what, row   # row=False: the rows of its contents say it
        self.shown = shown or rel

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Part: ...
    @overload
    def __get__(self, obj: Any, owner: type | None = None) -> Path: ...

    def __get__(self, obj: Any, owner: type | None = None) -> Part | Path:
        return self if obj is None else obj.path / self.rel


def each(shown: str, what: str) -> Callable[[_Fn], _Fn]:
    """Marks a method that names one of a family of paths (per rank, per host, per step) with
    how the README shows the family and its line."""
    def mark(fn: _Fn) -> _Fn:
        fn.row = (shown, what)  # type: ignore[attr-defined]
        return fn
    return mark


def rows(cls: type) -> list[tuple[str, str]]:
    """(shown name, description) of every path a class declares, in declaration order."""
    out = []
    for value in vars(cls).values():
        if isinstance(value, Part):
            out += [(value.shown, value.what)] if value.row else []
        elif hasattr(value, "row"):
            out.append(value.row)
    return out


@dataclass(frozen=True)
class RunDir:
    """`runs/<experiment>/<run_id>/`: what a run writes, one attribute per path."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, root: str | Path, experiment: str, run_id: str) -> RunDir:
        return cls(Path(root) / experiment / run_id)

    config = Part("config.yaml", "the resolved config, frozen once (ranks and restarts read it, never Hydra)")
    plan = Part("plan.json", "world size, batch math and each figure's source (`assumptions`), memory per device, "
                "peak FLOP/s")
    checkpoints = Part("checkpoints", "step-NNNNNNN.ckpt and last.ckpt (the newest)", "checkpoints/", row=False)

    @each("checkpoints/step-NNNNNNN.ckpt", "a complete checkpoint (a file, or a folder for sharded strategies)")
    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{int(step):07d}.ckpt"

    last_checkpoint = Part("checkpoints/last.ckpt", "a link to the newest complete checkpoint (a resume starts there)")
    metrics = Part("metrics.csv", "one row per logged step: train/*, perf/*, sys/*")
    summary = Part("summary.json", "status, steps, tokens, loss, throughput, memory per rank, utilization")
    final = Part("final", "model.safetensors, loadable with plain safetensors + torch (or an HF folder, a LoRA adapter)",
                 "final/")
    final_weights = Part("final/model.safetensors", "consolidated weights, loadable with plain safetensors + torch",
                         row=False)
    exports = Part("export", "what `loom export` writes, one folder per format, step and dtype", "export/", row=False)

    @each("export/<format>-step-N/", "`loom export` (another dtype than the run's: `-<dtype>` appended)")
    def export(self, fmt: str, step: int, dtype: str = "") -> Path:
        return self.exports / f"{fmt}-step-{int(step)}{'-' + dtype if dtype else ''}"

    evals = Part("eval", "benchmark scores (eval.tasks in the loop, `loom eval` after the fact), one file per step",
                 "eval/", row=False)

    @each("eval/step-NNNNNNN.json", "lm-eval's scores of the step: per task its metrics, stderr, version, n-shot "
          "(source: loop or checkpoint)")
    def eval_result(self, step: int) -> Path:
        return self.evals / f"step-{int(step):07d}.json"

    wandb = Part("wandb", "the offline wandb run (`wandb sync runs/.../wandb/offline-run-*` later)", "wandb/")
    tensorboard = Part("tensorboard", "TensorBoard event files (tracking=tensorboard or tracking.tensorboard=true)",
                       "tensorboard/")
    mlflow = Part("mlflow.json", "the MLflow run this run logs to (tracking=mlflow; the store: runs/mlruns)")
    profile = Part("profile", "the profiler's window (trainer.profile): traces, memory snapshots, summary.json",
                   "profile/", row=False)

    @each("profile/rank-N.pt.trace.json.gz", "a rank's trace (Chrome/Perfetto, TensorBoard's profiler plugin)")
    def profile_trace(self, rank: int) -> Path:
        return self.profile / f"rank-{rank}.pt.trace.json.gz"

    @each("profile/memory-rank-N.pickle", "a rank's CUDA memory snapshot (https://pytorch.org/memory_viz)")
    def profile_memory(self, rank: int) -> Path:
        return self.profile / f"memory-rank-{rank}.pickle"

    profile_summary = Part("profile/summary.json", "the window's step time by kind of work (`loom report` reads it)")
    plots = Part("plots", "loss.png, throughput.png, utilization.png, ranks.png (`loom report`)", "plots/")
    ranks = Part("ranks.jsonl", "every rank's step time, data wait and forward at each log step (stragglers)")
    world_history = Part("world_history.json", "one entry per attempt: its start step, world size, reason and span")
    logs = Part("logs", "every rank's log, failure and hang records", "logs/", row=False)

    @each("logs/rank-N.log", "every rank's log (only rank 0 talks to the console); full tracebacks")
    def log(self, rank: int | str) -> Path:
        return self.logs / f"rank-{rank}.log"

    @each("logs/torchrun-<host>.log", "torchrun's own output (kept off the console), one per host")
    def agent_log(self, host: str) -> Path:
        return self.logs / f"torchrun-{host}.log"

    @each("logs/error-rank-N.json", "a failing rank's failure record (summary.json `error` is the root one)")
    def failure(self, rank: int | str) -> Path:
        return self.logs / f"error-rank-{rank}.json"

    def failures(self) -> list[Path]:
        """Every rank's failure record on disk, by name."""
        return sorted(self.logs.glob(self.failure("*").name))

    @each("logs/hang-rank-N.txt", "every thread's stack of a rank whose watchdog fired (hardware.hang_timeout_s)")
    def hang(self, rank: int | str) -> Path:
        return self.logs / f"hang-rank-{rank}.txt"

    @each("logs/hang-rank-N.nccl.pkl", "that rank's NCCL flight recorder (its collectives), on NCCL")
    def hang_nccl(self, rank: int | str) -> Path:
        return self.logs / f"hang-rank-{rank}.nccl.pkl"

    nccl_trace = Part("logs/nccl_trace_rank_", "NCCL's own flight-recorder dumps (a prefix: one file per rank)",
                      "logs/nccl_trace_rank_N")
    slurm = Part("slurm", "hardware.launcher=slurm: the job script, its job ids and output", "slurm/", row=False)
    sbatch = Part("slurm/job.sbatch", "the SLURM job script (`sbatch` it again by hand to resubmit)")
    slurm_job = Part("slurm/job_id", "the last SLURM job submitted for the run")
    slurm_jobs = Part("slurm/jobs.log", "every job submitted: id, time, script")

    @each("slurm/slurm-<job>.out", "a SLURM job's output")
    def slurm_out(self, job: str) -> Path:
        return self.slurm / f"slurm-{job}.out"

    trainjob = Part("trainjob.yaml", "hardware.launcher=kubernetes: the TrainJob (`kubectl apply -f` it)")
    kubernetes = Part("kubernetes.json", "the TrainJob's name and namespace the launcher follows")
    lock = Part(".lock", "held by the launcher while the run trains (one launcher per run dir)")
    ranks_lock = Part(".ranks.lock", "held by every live rank (a new launcher waits until none is left)")

    def siblings(self) -> list[RunDir]:
        """The other run dirs beside this one (same experiment or sweep), by their config."""
        return [RunDir(p.parent) for p in sorted(self.path.parent.glob(f"*/{RunDir.config.rel}"))
                if p.parent != self.path]

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class SweepDir:
    """`runs/<experiment>/sweeps/<sweep_id>/`: one run dir per trial and the manifest."""

    path: Path
    FOLDER = "sweeps"   # runs/<experiment>/sweeps/: beside the experiment's run dirs

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, root: str | Path, experiment: str, sweep_id: str) -> SweepDir:
        return cls(Path(root) / experiment / cls.FOLDER / sweep_id)

    manifest = Part("manifest.json", "the sweep's command, objective and every trial's state (a rerun resumes it)")

    @each("<run_id>/", "one trial's run dir (as above)")
    def trial(self, run_id: str) -> RunDir:
        return RunDir(self.path / run_id)

    def __fspath__(self) -> str:
        return str(self.path)


def run_dir_table() -> str:
    """README "What a run writes": the run dir's paths and the sweep dir's, one line each."""
    run, sweep = rows(RunDir), rows(SweepDir)
    width = max(len(name) for name, _ in run + sweep) + 2
    lines = ["```", "runs/<experiment>/<run_id>/"]
    lines += [f"  {name:<{width}} {what}" for name, what in run]
    lines += [f"runs/<experiment>/{SweepDir.FOLDER}/<sweep_id>/"]
    lines += [f"  {name:<{width}} {what}" for name, what in sweep]
    return "\n".join([*lines, "```"])
