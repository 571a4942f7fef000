"""SLURM: render an sbatch script from the hardware profile, submit it, finish the job.

`loom train hardware=slurm ...` on a login node validates and plans as usual, freezes the run
dir, renders `<run>/slurm/job.sbatch` from `scripts/slurm/job.sbatch` and the profile's
`hardware.slurm` block, and submits it with `sbatch` (`--dry-run`: only writes it). In the
allocation, `srun --ntasks-per-node=1` starts one torchrun agent per node, the same torchrun
command `loom.launch` runs on one machine, so ranks, elastic restarts (`max_restarts`) and the
worker are the same code path everywhere. SIGUSR1 before the time limit reaches the script
(`--signal=B:USR1@N`), which turns it into SIGTERM for the agents; the ranks checkpoint and
stop ("preempted"), and the script runs `scontrol requeue`; the requeued job runs the same
script on the same run dir and resumes from `checkpoints/last`.

Why an sbatch script and not hydra-submitit-launcher (listed in DESIGN.md) or submitit:
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

`python -m loom.slurm mark|finish RUN_DIR` are the script's two helpers (no torch imported).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from loom.config import ConfigError

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_PREEMPTED = 0, 1, 2, 143

# sbatch options Loom sets from the profile: hardware.slurm.extra_args may not set them again.
MANAGED = {
    "--nodes": "hardware.num_nodes", "-N": "hardware.num_nodes",
    "--ntasks-per-node": "one torchrun per node", "--ntasks": "one torchrun per node",
    "-n": "one torchrun per node",
    "--gpus-per-node": "hardware.devices", "--gpus": "hardware.devices", "-G": "hardware.devices",
    "--gres": "hardware.devices", "--gpus-per-task": "hardware.devices",
    "--time": "hardware.slurm.time_limit", "-t": "hardware.slurm.time_limit",
    "--partition": "hardware.slurm.partition", "-p": "hardware.slurm.partition",
    "--account": "hardware.slurm.account", "-A": "hardware.slurm.account",
    "--qos": "hardware.slurm.qos", "-q": "hardware.slurm.qos",
    "--constraint": "hardware.slurm.constraint", "-C": "hardware.slurm.constraint",
    "--cpus-per-task": "hardware.slurm.cpus_per_task", "-c": "hardware.slurm.cpus_per_task",
    "--mem": "hardware.slurm.mem_gb",
    "--signal": "hardware.slurm.signal_before_s",
    "--requeue": "Loom requeues at the time limit", "--no-requeue": "Loom requeues at the time limit",
    "--output": "<run>/slurm/slurm-%j.out", "-o": "<run>/slurm/slurm-%j.out",
    "--error": "<run>/slurm/slurm-%j.out", "-e": "<run>/slurm/slurm-%j.out",
    "--open-mode": "append (requeued attempts share the log)",
    "--job-name": "loom-<run id>", "-J": "loom-<run id>",
}
# squeue states in which a job still holds (or will hold) the run dir.
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"}


def template_path() -> Path:
    env = os.environ.get("LOOM_SLURM_TEMPLATE")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "job.sbatch"


def time_limit_s(text: str) -> int:
    """sbatch --time in seconds: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def cpus_per_task(cfg: DictConfig) -> int:
    """CPUs of the one task per node: the profile's, else one per rank plus its data workers."""
    hw = cfg.hardware
    return int(hw.slurm.cpus_per_task or hw.devices * (1 + hw.dataloader_workers))


def check_allocation(cfg: DictConfig) -> None:
    """The SLURM request against the run (config validation, so `loom plan` checks it too).

    One torchrun per node: the allocation is num_nodes x 1 task, each task holding
    `hardware.devices` GPUs (world size = num_nodes x devices; TP groups stay within a node,
    see the strategy checks). Options Loom sets itself may not be set again in extra_args.
    """
    hw = cfg.hardware
    sl = hw.slurm
    if sl is None:
        return
    for arg in sl.extra_args or []:
        text = str(arg).strip()
        name = re.split(r"[=\s]", text, maxsplit=1)[0]
        if not name.startswith("-"):
            raise ConfigError(
                f"Invalid config: hardware.slurm.extra_args has {text!r}: each item is one sbatch "
                "option, e.g. '--exclusive' or '--mail-type=END'.")
        if name in MANAGED:
            raise ConfigError(
                f"Invalid config: hardware.slurm.extra_args has {text!r}, but Loom sets {name} itself "
                f"from {MANAGED[name]}; set that instead and drop {name} from extra_args.")
    limit = time_limit_s(str(sl.time_limit))
    if not 0 < sl.signal_before_s < limit:
        raise ConfigError(
            f"Invalid config: hardware.slurm.signal_before_s={sl.signal_before_s} must be > 0 and below "
            f"hardware.slurm.time_limit={sl.time_limit} ({limit} s): SIGUSR1 comes that long before "
            "the limit, to checkpoint and requeue.")
    if not 0 < sl.rdzv_port < 64536:
        raise ConfigError(f"Invalid config: hardware.slurm.rdzv_port={sl.rdzv_port} must be a TCP port "
                          "below 64536 (the job id % 1000 is added to it).")
    if sl.cpus_per_task is not None and sl.cpus_per_task < hw.devices:
        raise ConfigError(
            f"Invalid config: hardware.slurm.cpus_per_task={sl.cpus_per_task} but each node's single "
            f"task (one torchrun) runs hardware.devices={hw.devices} rank(s): set it >= {hw.devices}, "
            "or null for devices x (1 + dataloader_workers).")


def check_submit(cfg: DictConfig, dry_run: bool) -> None:
    """`loom train` with launcher=slurm: sbatch must be here unless only the script is wanted."""
    if dry_run or shutil.which("sbatch"):
        return
    raise ConfigError(
        f"Invalid config: hardware.launcher=slurm (hardware={cfg.hardware.name}) submits the run "
        "with `sbatch`, which is not on PATH here. Run `loom train` on a SLURM login node, or add "
        "--dry-run (`loom train --dry-run hardware=slurm ...`) to only write <run>/slurm/job.sbatch "
        "and print the sbatch command that submits it.")


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
             f"--output={run_dir / 'slurm' / 'slurm-%j.out'}"]
    return opts + [str(a).strip() for a in sl.extra_args or []]


def render(cfg: DictConfig, run_dir: Path, python: str = sys.executable) -> str:
    """The job script of a frozen run (run dir and python as absolute paths the nodes see)."""
    from loom.launch import multi_node, torchrun_command

    hw, sl = cfg.hardware, cfg.hardware.slurm
    run_dir = Path(run_dir).resolve()
    script = run_dir / "slurm" / "job.sbatch"
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


def _groups(cmd: list[str]) -> list[int]:
    """Start indexes of the command's words, `-m module` kept together on one line."""
    out, i = [], 0
    while i < len(cmd):
        out.append(i)
        i += 2 if cmd[i] == "-m" else 1
    return out


def write_script(cfg: DictConfig, run_dir: Path) -> Path:
    path = Path(run_dir) / "slurm" / "job.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".job.sbatch.{os.getpid()}.tmp")
    tmp.write_text(render(cfg, run_dir))
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def active_job(run_dir: Path) -> tuple[str, str] | None:
    """The last job submitted for this run, if squeue says it is still queued or running."""
    last = Path(run_dir) / "slurm" / "job_id"
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
    (run_dir / "slurm" / "job_id").write_text(job + "\n")
    with open(run_dir / "slurm" / "jobs.log", "a") as f:
        f.write(f"{job}\t{time.strftime('%Y-%m-%dT%H:%M:%S')}\t{script}\n")
    print(f"Submitted run {cfg.run.id} as SLURM job {job} ({cfg.hardware.num_nodes} node(s) x "
          f"{cfg.hardware.devices}); script {script}\n"
          f"job log: {run_dir / 'slurm' / f'slurm-{job}.out'}; summary.json appears when it ends\n"
          f"run dir: {run_dir}")
    return EXIT_OK


# ----------------------------------------------------------------------------- in the job

def finish(run_dir: Path, rc: int, mark: str | None) -> int:
    """After srun returned (every node's ranks exited): settle summary.json and map it to the
    job's exit code: 0 completed, 143 preempted with progress (the script requeues), 1 else."""
    from loom.config import load_frozen
    from loom.console import print_summary
    from loom.launch import settle_summary

    run_dir = Path(run_dir).resolve()
    cfg = load_frozen(run_dir / "config.yaml")
    summary = settle_summary(cfg, run_dir, rc, mark, wait_for_rank0=False)
    if summary is not None:
        print_summary(run_dir, summary)
    print(f"run dir: {run_dir}")
    status = summary["status"] if summary else None
    if status == "completed" and rc == 0:
        return EXIT_OK
    if status == "preempted":
        start, step = summary.get("resumed_from_step"), summary.get("global_step", 0)
        if start is not None and step <= start:
            print(f"loom: preempted at step {step} without progress since the last start: not requeueing",
                  file=sys.stderr)
            return EXIT_FAILED
        return EXIT_PREEMPTED
    print(f"Training failed (exit {rc}); see {run_dir / 'logs'}", file=sys.stderr)
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loom.slurm", description="helpers of Loom's SLURM job script")
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("mark", help="print summary.json's fingerprint before the ranks start")
    m.add_argument("run_dir")
    f = sub.add_parser("finish", help="settle summary.json after srun; exit 0 | 143 (requeue) | 1")
    f.add_argument("run_dir")
    f.add_argument("--rc", type=int, required=True)
    f.add_argument("--mark", default="-")
    args = p.parse_args(argv)
    from loom.launch import summary_mark

    if args.verb == "mark":
        print(summary_mark(Path(args.run_dir)) or "-")
        return EXIT_OK
    return finish(Path(args.run_dir), args.rc, None if args.mark == "-" else args.mark)


if __name__ == "__main__":
    sys.exit(main())
