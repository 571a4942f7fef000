"""Fake `sbatch`, `srun`, `scontrol` and `squeue` for running Loom's real job script on one machine.

`install(bin_dir, state_dir)` writes them into `bin_dir` (put it first on PATH). They keep their
state in `state_dir`: `calls.log` (every call), `pids` (each started batch script, one a line),
`job-<id>.script`. Like SLURM they:
- sbatch: read the script's #SBATCH lines, start `bash script` detached with SLURM_JOB_ID,
  SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST (localhost per node), SLURM_CPUS_PER_TASK and
  SLURM_RESTART_COUNT set, its output appended to --output (%j expanded); print the job id.
- srun: start the command once per node (SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID set),
  forward SIGTERM/SIGINT/SIGUSR1/SIGUSR2 to them, --kill-on-bad-exit=1: a failed task stops
  the others; exit with the first non-zero code.
- scontrol show hostnames LIST: one name a line; scontrol requeue ID: start the job's script
  again with SLURM_RESTART_COUNT + 1 (the requeued job).
- squeue: reports no active job.
`install_step_srun` swaps srun for one that trains nothing (see STEP_SRUN).
"""

from __future__ import annotations

import sys
from pathlib import Path

COMMON = r'''
import os, re, signal, subprocess, sys, time
STATE = os.environ["LOOM_SHIM_STATE"]

def log(*words):
    with open(os.path.join(STATE, "calls.log"), "a") as f:
        f.write(" ".join(words) + "\n")

def start_job(job, script, restart):
    text = open(script).read()
    opts = dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", text, re.M))
    nodes = int(opts["nodes"].split("-")[-1])
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": str(nodes),
           "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes),
           "SLURM_CPUS_PER_TASK": opts.get("cpus-per-task", "1"), "SLURM_RESTART_COUNT": str(restart)}
    out = open(opts["output"].replace("%j", job), "a")
    p = subprocess.Popen(["bash", script], stdout=out, stderr=subprocess.STDOUT, env=env,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    with open(os.path.join(STATE, "pids"), "a") as f:
        f.write(f"{p.pid}\n")
    with open(os.path.join(STATE, f"job-{job}.script"), "w") as f:
        f.write(script)
'''

SBATCH = r'''
args = sys.argv[1:]
log("sbatch", *args)
script = [a for a in args if not a.startswith("-")][-1]
job = os.environ.get("LOOM_SHIM_JOB_ID", "4242")
start_job(job, os.path.abspath(script), 0)
print(job if "--parsable" in args else f"Submitted batch job {job}")
'''

SRUN = r'''
args = sys.argv[1:]
log("srun", *args)
opts, i = {}, 0
while i < len(args) and args[i].startswith("-"):
    key, _, val = args[i].partition("=")
    opts[key] = val
    i += 1
cmd = args[i:]
nodes = int(opts.get("--nodes") or os.environ["SLURM_JOB_NUM_NODES"])
procs = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n),
                                     "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": str(nodes),
                                     "SLURM_NTASKS": str(nodes)})
         for n in range(nodes)]

def forward(signum, frame):
    log("srun forwards", str(signum))
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)

for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
codes = [None] * nodes
stopping = False
while any(c is None for c in codes):
    codes = [p.poll() for p in procs]
    if opts.get("--kill-on-bad-exit") == "1" and not stopping and any(c not in (None, 0) for c in codes):
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.terminate()
    time.sleep(0.1)
bad = [c for c in codes if c != 0]
sys.exit(bad[0] % 256 if bad else 0)
'''

SCONTROL = r'''
args = sys.argv[1:]
log("scontrol", *args)
if args[:2] == ["show", "hostnames"]:
    try:
        print("\n".join(args[2].split(",")), flush=True)
    except BrokenPipeError:  # `| head -n 1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
elif args[:1] == ["requeue"]:
    job = args[1]
    script = open(os.path.join(STATE, f"job-{job}.script")).read()
    start_job(job, script, int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1)
else:
    sys.exit(f"scontrol shim: unsupported {args}")
'''

SQUEUE = r'''
log("squeue", *sys.argv[1:])
'''


def install(bin_dir: Path, state_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL), ("squeue", SQUEUE)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{COMMON}\n{body}")
        path.chmod(0o755)


# A stand-in for `srun` that trains nothing, for the job script's own logic (what it does with
# the ranks' outcome): it writes the summary.json the ranks would have written and exits as
# they would. First attempt: waits for SIGTERM (the script's USR1 trap, or scancel), then writes
# `preempted.json` from the state dir and exits 143. A requeued attempt (SLURM_RESTART_COUNT
# > 0) writes `completed.json` and exits 0. It runs in the run dir (the script cd's there).
STEP_SRUN = r'''
import shutil
log("srun", *sys.argv[1:])

def write(name):
    shutil.copy(os.path.join(STATE, name), "summary.json")

if int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
    write("completed.json")
    sys.exit(0)

def stop(signum, frame):
    log("srun stopped by", str(signum))
    write("preempted.json")
    sys.exit(143)

signal.signal(signal.SIGTERM, stop)
open(os.path.join(STATE, "srun.ready"), "w").close()
while True:
    time.sleep(0.05)
'''


def install_step_srun(bin_dir: Path) -> None:
    """Replace the installed `srun` with STEP_SRUN (after `install`)."""
    path = bin_dir / "srun"
    path.write_text(f"#!{sys.executable}\n{COMMON}\n{STEP_SRUN}")
    path.chmod(0o755)
