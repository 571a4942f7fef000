"""Inside each pod of a Loom TrainJob: `python -m loom.launch.pod <run dir>` (loom.launch.kubernetes).

Kubeflow Trainer's torch-distributed runtime starts `numNodes` pods and injects torchrun's
rendezvous as PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
(the first pod's address). This entry reads them, checks them against the frozen run (the
node count the run dir was frozen for, or its elastic range; the processes per node), and
runs what the SLURM job script runs on a node: `loom.finish mark`, Loom's torchrun agent on a
c10d rendezvous at PET_MASTER_ADDR:PET_MASTER_PORT keyed by the run id, then `loom.finish
finish`, whose exit code is the pod's (0 completed, 143 preempted, 1 failed). A restarted pod,
or a job resized and resubmitted (`loom train ... hardware.num_nodes=N`, which re-freezes the run
at the new world), resumes from the run dir's last checkpoint like any Loom launch.

SIGTERM (the pod being stopped: a suspended or deleted TrainJob) reaches the agent once, so the
ranks checkpoint at the next step boundary within the pod's terminationGracePeriodSeconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import EXIT_INVALID
from loom.launch import nnodes, torchrun_command, worker_env
from loom.launch.kubernetes import PET_KEYS
from loom.rundir.paths import RunDir

# How the SLURM job script calls the same helpers (loom.finish's `mark` and `finish`).
FINISH = ["-m", "loom.finish"]


def rendezvous(env: dict[str, str]) -> dict[str, str]:
    """The PET_* rendezvous the runtime injected; a missing one is the pod's error (exit 2)."""
    missing = [k for k in PET_KEYS if not env.get(k)]
    if missing:
        raise SystemExit(f"loom.launch.pod: {', '.join(missing)} not set: this entry runs in a pod of a TrainJob "
                         "whose torch runtime injects the PET_* rendezvous (Kubeflow Trainer's torch-distributed)")
    return {k: env[k] for k in PET_KEYS}


def check_against_run(cfg: DictConfig, pet: dict[str, str]) -> None:
    """The runtime's node and process counts must be the frozen run's: a TrainJob resized by hand
    would train another world than the run dir says; `loom train ... hardware.num_nodes=N` resizes it."""
    hw = cfg.hardware
    if pet["PET_NNODES"] != nnodes(cfg):
        raise SystemExit(f"loom.launch.pod: PET_NNODES={pet['PET_NNODES']} but the run dir was frozen for "
                         f"{nnodes(cfg)} node(s); resize through Loom: loom train <the same overrides> "
                         f"hardware.num_nodes=<N> (the run resumes at the new world) and apply its trainjob.yaml")
    if pet["PET_NPROC_PER_NODE"] not in (str(hw.devices), "auto"):
        raise SystemExit(f"loom.launch.pod: PET_NPROC_PER_NODE={pet['PET_NPROC_PER_NODE']} but the run has "
                         f"hardware.devices={hw.devices} per node")


def agent_command(cfg: DictConfig, run_dir: Path, pet: dict[str, str]) -> list[str]:
    """Loom's torchrun agent for this pod: the launcher's own torchrun command, its c10d rendezvous
    at the first pod (whose agent hosts the store), keyed by the run id."""
    return torchrun_command(cfg, run_dir, endpoint=f"{pet['PET_MASTER_ADDR']}:{pet['PET_MASTER_PORT']}")


def run_pod(run_dir: Path, env: dict[str, str] | None = None) -> int:
    """mark, agent, finish: the pod's exit code."""
    from loom.rundir.config_file import load_frozen

    env = dict(os.environ if env is None else env)
    pet = rendezvous(env)
    cfg = load_frozen(RunDir(run_dir).config)
    check_against_run(cfg, pet)
    print(f"loom: pod {socket.gethostname()}: node rank {pet['PET_NODE_RANK']} of {pet['PET_NNODES']} x "
          f"{cfg.hardware.devices} process(es); rendezvous at {pet['PET_MASTER_ADDR']}:{pet['PET_MASTER_PORT']} "
          f"(run.id={cfg.run.id}); run dir {run_dir}", flush=True)
    mark = subprocess.run([sys.executable, *FINISH, "mark", str(run_dir)], capture_output=True, text=True,
                          env=env).stdout.strip() or "-"
    agent = subprocess.Popen(agent_command(cfg, run_dir, pet), env={**worker_env(cfg, run_dir), **_threads(cfg, env)})
    stopping: list[int] = []

    def forward(signum, frame) -> None:  # once: a second SIGTERM would abandon the ranks mid-checkpoint
        if not stopping and agent.poll() is None:
            stopping.append(signum)
            agent.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = agent.wait()
    print(f"loom: pod {socket.gethostname()}: torchrun exited with {rc}", flush=True)
    return subprocess.run([sys.executable, *FINISH, "finish", str(run_dir), "--rc", str(rc), "--mark", mark],
                          env=env).returncode


def _threads(cfg: DictConfig, env: dict[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS from the pod's own CPUs (its cgroup), unless the pod env sets it."""
    if env.get("OMP_NUM_THREADS"):
        return {}
    from loom.hardware.machine import usable_cores

    return {"OMP_NUM_THREADS": str(max(1, usable_cores() // cfg.hardware.devices))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m loom.launch.pod <run dir>", file=sys.stderr)
        return EXIT_INVALID
    return run_pod(Path(argv[0]).resolve())


if __name__ == "__main__":
    sys.exit(main())
