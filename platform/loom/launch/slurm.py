"""SLURM: render an sbatch script from the hardware profile and submit it.

`loom train hardware=slurm ...` on a login node validates and plans as usual, freezes the run
dir, renders `<run>/slurm/job.sbatch` from Loom's bundled template (`scripts/slurm/job.sbatch` of a
checkout, package data of a wheel: compose/paths.py) and the profile's
`hardware.slurm` block, and submits it with `sbatch` (`--dry-run`: only writes it). In the
allocation, `srun --ntasks-per-node=1` starts one torchrun agent per node, the same torchrun
command `loom.launch` runs on one machine, so ranks, elastic restarts (`max_restarts`) and the
worker are the same code path everywhere. SIGUSR1 before the time limit reaches the script
(`--signal=B:USR1@N`), which turns it into SIGTERM for the agents; the ranks checkpoint and
stop ("preempted"), and the script runs `scontrol requeue`; the requeued job runs the same
script on the same run dir and resumes from `checkpoints/last`.

Why an sbatch script and not hydra-submitit-launcher (a dependency of the `sweeps` extra) or submitit:
- hydra-submitit-launcher is a Hydra *launcher plugin*: it re-runs the `@hydra.main` task
  function inside the allocation, per job. Loom composes once with the compose API, freezes
  the config, and its ranks never re-run Hydra; the plugin has nothing to plug into.
- submitit pickles a Python callable into the job folder and unpickles it on the nodes, and
  starts one Python process per SLURM task (ranks as tasks, Lightning's SLURMEnvironment).
  Loom treats pickles as code, wants torchrun on every node (same worker path, elastic
  restarts), and needs nothing from submitit that sbatch does not do directly.
- A script is what SLURM users read, audit and resubmit by hand (`sbatch <run>/slurm/job.sbatch`),
  and what a cluster admin can adapt (`LOOM_SLURM_TEMPLATE` names another template;
  `hardware.slurm.setup` adds `module load` lines). Requeue is an explicit `scontrol requeue`.

`python -m loom.finish mark|finish RUN_DIR` are the script's two helpers (no torch imported).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from loom.atomic import atomic_write_text
from loom.compose.paths import bundled
from loom.errors import EXIT_OK, ConfigError
from loom.launch import gpu_env, multi_node, torchrun_command
from loom.rundir.paths import RunDir

# squeue states in which a job still holds (or will hold) the run dir.
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"}


def template_path() -> Path:
    env = os.environ.get("LOOM_SLURM_TEMPLATE")
    return Path(env) if env else bundled("slurm") / "job.sbatch"


def cpus_per_task(cfg: DictConfig) -> int:
    """CPUs of the one task per node: the profile's, else one per rank plus its data workers."""
    hw = cfg.hardware
    return int(hw.slurm.cpus_per_task or hw.devices * (1 + hw.dataloader_workers))


# ----------------------------------------------------------------------------- rendering

def sbatch_options(cfg: DictConfig, run_dir: Path) -> list[str]:
    hw, sl = cfg.hardware, cfg.hardware.slurm
    low = hw.get("min_nodes")
    nodes = f"{low}-{hw.num_nodes}" if low is not None and low < hw.num_nodes else str(hw.num_nodes)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"loom-{cfg.experiment}-{cfg.run.id}")
    opts = [f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if hw.accelerator == "gpu":
        opts.append(f"--gpus-per-node={sl.gpus_per_node or hw.devices}")
    opts.append(f"--cpus-per-task={cpus_per_task(cfg)}")
    if sl.mem_gb:
        opts.append(f"--mem={int(sl.mem_gb * 1024)}M")
    opts.append(f"--time={sl.time_limit}")
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("qos", "--qos"),
                      ("constraint", "--constraint")):
        if sl[key]:
            opts.append(f"{flag}={sl[key]}")
    opts += [f"--signal=B:USR1@{sl.signal_before_s}", "--requeue", "--open-mode=append",
             f"--output={RunDir(run_dir).slurm_out('%j')}"]
    return opts + [str(a).strip() for a in sl.extra_args or []]


def render(cfg: DictConfig, run_dir: Path, python: str = sys.executable) -> str:
    """The job script of a frozen run (run dir and python as absolute paths the nodes see)."""
    hw, sl = cfg.hardware, cfg.hardware.slurm
    run_dir = Path(run_dir).resolve()
    script = RunDir(run_dir).sbatch
    marks = {"python": "@@PYTHON@@", "endpoint": "@@RDZV@@", "run_dir": "@@RUNDIR@@"}
    cmd = torchrun_command(cfg, marks["run_dir"], endpoint=marks["endpoint"], python=marks["python"])
    torchrun = " \\\n    ".join(shlex.join(cmd[i:i + 2]) if cmd[i] == "-m" else shlex.quote(cmd[i])
                                 for i in _groups(cmd))
    torchrun = (torchrun.replace(marks["python"], '"$PYTHON"')
                .replace(f"--rdzv-endpoint={marks['endpoint']}", '--rdzv-endpoint="$RDZV_ENDPOINT"')
                .replace(marks["run_dir"], '"$RUN_DIR"'))
    srun = ['--nodes="$SLURM_JOB_NUM_NODES"', "--ntasks-per-node=1", f"--cpus-per-task={cpus_per_task(cfg)}"]
    if hw.accelerator == "gpu":
        srun.append(f"--gpus-per-node={sl.gpus_per_node or hw.devices}")
    if (hw.get("min_nodes") or hw.num_nodes) >= hw.num_nodes:
        srun.append("--kill-on-bad-exit=1")  # not elastic: one node's failure ends the step
    rdzv_env = ("# every rendezvous round gets a fresh worker store (see loom.launch.worker_env)\n"
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") if multi_node(cfg) else ""
    values = {
        "run_id": str(cfg.run.id),
        "experiment": str(cfg.experiment),
        "hardware": str(hw.name),
        "devices": str(hw.devices),
        "signal_before_s": str(sl.signal_before_s),
        "script": shlex.quote(str(script)),
        "sbatch_lines": "\n".join(f"#SBATCH {o}" for o in sbatch_options(cfg, run_dir)),
        "run_dir": shlex.quote(str(run_dir)),
        "python": shlex.quote(python),
        "setup": "\n".join(str(line) for line in sl.setup or []) or ":",
        "rdzv_env": rdzv_env,
        "gpu_env": gpu_env_lines(cfg, run_dir),
        "rdzv_port": str(sl.rdzv_port),
        "rdzv_endpoint": str(hw.rdzv_endpoint) if hw.rdzv_endpoint else "$HEAD_NODE:$RDZV_PORT",
        "srun_options": " ".join(srun),
        "torchrun": torchrun,
    }
    text = template_path().read_text()
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", text)) - set(values))
    if missing:
        raise ConfigError(f"Invalid config: the SLURM template {template_path()} uses unknown "
                          f"placeholders {', '.join(missing)}; known: {', '.join(sorted(values))}.")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


def gpu_env_lines(cfg: DictConfig, run_dir: Path) -> str:
    """`export KEY="${KEY:-default}"` for loom.launch.gpu_env (NCCL error handling, flight
    recorder, allocator): the same defaults as torchrun launches, and the user's own env wins."""
    env = gpu_env(cfg, run_dir)
    if not env:
        return ""
    lines = ["# GPU ranks: NCCL aborts on errors, flight-recorder dump on timeout, expandable segments"]
    lines += [f'export {k}="${{{k}:-{v}}}"' for k, v in env.items()]
    return "\n".join(lines)


def _groups(cmd: list[str]) -> list[int]:
    """Start indexes of the command's words, `-m module` kept together on one line."""
    out, i = [], 0
    while i < len(cmd):
        out.append(i)
        i += 2 if cmd[i] == "-m" else 1
    return out


def write_script(cfg: DictConfig, run_dir: Path) -> Path:
    path = RunDir(run_dir).sbatch
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, render(cfg, run_dir), mode=0o755)


def active_job(run_dir: Path) -> tuple[str, str] | None:
    """The last job submitted for this run, if squeue says it is still queued or running."""
    last = RunDir(run_dir).slurm_job
    if not last.exists() or not shutil.which("squeue"):
        return None
    job = last.read_text().strip()
    p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    state = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
    return (job, state) if state in ACTIVE else None


def submit(cfg: DictConfig, run_dir: Path, dry_run: bool = False) -> int:
    """Write `<run>/slurm/job.sbatch` and submit it (exit 0 = submitted; the job runs later)."""
    run_dir = Path(run_dir)
    script = write_script(cfg, run_dir)
    command = ["sbatch", str(script)]
    if dry_run:
        print(f"wrote {script}\nsubmit it with: {shlex.join(command)}\nrun dir: {run_dir}")
        return EXIT_OK
    running = active_job(run_dir)
    if running:
        raise ConfigError(
            f"Invalid config: run {cfg.run.id} already has SLURM job {running[0]} ({running[1]}) in "
            f"{run_dir}; two jobs must not train one run dir. Wait for it, or `scancel {running[0]}` "
            "and submit again.")
    p = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=run_dir)
    if p.returncode != 0:
        raise ConfigError(f"Invalid config: sbatch refused {script} (exit {p.returncode}): "
                          f"{(p.stderr or p.stdout).strip()}")
    job = p.stdout.strip().splitlines()[-1].split(";")[0] if p.stdout.strip() else "?"
    RunDir(run_dir).slurm_job.write_text(job + "\n")
    with open(RunDir(run_dir).slurm_jobs, "a") as f:
        f.write(f"{job}\t{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{script}\n")
    print(f"Submitted run {cfg.run.id} as SLURM job {job} ({cfg.hardware.num_nodes} node(s) x "
          f"{cfg.hardware.devices}); script {script}\n"
          f"job log: {RunDir(run_dir).slurm_out(job)}; summary.json appears when it ends\n"
          f"run dir: {run_dir}")
    return EXIT_OK
