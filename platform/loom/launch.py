"""Start the ranks of a frozen run: in-process for one process, torchrun for more.

torchrun (torch.distributed.run, the elastic agent) is started as a child process so the
launcher stays free of torch, and restarts (`--max-restarts`) re-run the same worker on
the same run dir, which then resumes from its last checkpoint.

Multi-node: every node runs the same `loom train` command; each launcher starts one torchrun
agent, and the agents meet at the c10d rendezvous `hardware.rdzv_endpoint` (hosted by the agent
on that host). torchrun assigns node ranks there, so a launcher knows its node only by name.
All nodes share one run dir (named by `run.id`, on storage every node sees); global rank 0
writes the run-level files. SLURM (`hardware.launcher=slurm`) starts the same torchrun command
on every node from a rendered sbatch script instead: see `loom.slurm`.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

# The multi-node failure-summary grace: how long a launcher whose ranks failed waits for global
# rank 0 (perhaps on another node, still in its `finally`) to write summary.json itself.
SUMMARY_GRACE_S = 10.0


def nnodes(cfg: DictConfig) -> str:
    """torchrun's --nnodes: `N`, or `MIN:N` for an elastic run (hardware.min_nodes)."""
    hw = cfg.hardware
    low = hw.get("min_nodes")
    return f"{low}:{hw.num_nodes}" if low is not None and low < hw.num_nodes else str(hw.num_nodes)


def torchrun_command(cfg: DictConfig, run_dir: Path | str, endpoint: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """The torchrun command line of one node. `endpoint` overrides hardware.rdzv_endpoint (the
    SLURM script passes its first node); with neither, and one node, a standalone rendezvous."""
    hw = cfg.hardware
    endpoint = endpoint or hw.rdzv_endpoint
    cmd = [
        python, "-m", "torch.distributed.run",
        f"--nproc-per-node={hw.devices}",
        f"--nnodes={nnodes(cfg)}",
        f"--max-restarts={hw.max_restarts}",
        "--monitor-interval=0.5",
    ]
    if hw.num_nodes == 1 and not endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={cfg.run.id}"]
    return [*cmd, "-m", "loom.worker", str(run_dir)]


def multi_node(cfg: DictConfig) -> bool:
    return cfg.hardware.num_nodes > 1 or (cfg.hardware.get("min_nodes") or 1) > 1


def worker_env(cfg: DictConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["LOOM_LAUNCH_TIME"] = str(time.time())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // cfg.hardware.devices)))
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONUNBUFFERED"] = "1"
    if multi_node(cfg):
        # Without this, the rank-0 agent hosts one worker store for every rendezvous round, and
        # loom.distributed keys it by the restart count, which differs between nodes (a node
        # restarted because another one failed keeps its count): the ranks then wait on
        # different keys until the timeout. Off, rank 0 hosts a fresh store every round.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def hosts_rendezvous(endpoint: str | None) -> bool:
    """Whether `endpoint`'s host names this machine (so its torchrun agent hosts the c10d store)."""
    if not endpoint:
        return True
    host = endpoint.rpartition(":")[0].strip("[]")
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    if host in names or host.startswith("127.") or host == "::1":
        return True
    try:
        mine = {a[4][0] for n in names for a in socket.getaddrinfo(n, None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs)


def node_banner(cfg: DictConfig) -> str:
    """Which node this launcher is, as far as it can know before the rendezvous ranks nodes."""
    hw = cfg.hardware
    where = ("hosts the rendezvous" if hosts_rendezvous(hw.rdzv_endpoint)
             else "joins the rendezvous")
    return (f"node {socket.gethostname()} (launcher pid {os.getpid()}): one of {nnodes(cfg)} node(s) "
            f"x {hw.devices} process(es); {where} at {hw.rdzv_endpoint} (run.id={cfg.run.id}); "
            "torchrun assigns node ranks there, this node's ranks log to logs/rank-N.log")


def summary_mark(run_dir: Path) -> str | None:
    """A fingerprint of summary.json as it is now (None: absent). Compared after the ranks exit,
    it says whether global rank 0 wrote a summary during this launch; unlike a modification time
    it does not depend on the clocks of the nodes and the shared file server agreeing."""
    try:
        return hashlib.sha1((Path(run_dir) / "summary.json").read_bytes()).hexdigest()
    except OSError:
        return None


def settle_summary(cfg: DictConfig, run_dir: Path, rc: int, mark: str | None,
                   wait_for_rank0: bool | None = None) -> dict | None:
    """The run's summary once this launch's ranks exited (`mark`: `summary_mark` before launch).

    Rank 0's, when it wrote one during the launch (summary.json changed since `mark`); else, if
    the ranks failed, a `failed` one written here. Multi-node, global rank 0 may run on another
    node and still be in its `finally`: wait up to SUMMARY_GRACE_S for it before writing, so a
    node without rank 0 does not replace a good (e.g. `preempted`) summary with `failed`.
    (`wait_for_rank0=False`: every rank has exited already, as after srun.)
    """
    from loom.tracking.summary import empty_summary, read_summary, write_summary

    if rc != 0:
        wait = multi_node(cfg) if wait_for_rank0 is None else wait_for_rank0
        deadline = time.monotonic() + (SUMMARY_GRACE_S if wait else 0.0)
        while summary_mark(run_dir) == mark and time.monotonic() < deadline:
            time.sleep(0.2)
        if summary_mark(run_dir) == mark:
            # The workers died before rank 0 could write it: record the failure here.
            write_summary(run_dir, empty_summary(cfg, str(cfg.run.id)))
    return read_summary(run_dir)


def launch(cfg: DictConfig, run_dir: Path) -> int:
    """Run all ranks to the end; returns the exit code of the training."""
    env = worker_env(cfg)
    if cfg.hardware.devices * cfg.hardware.num_nodes == 1:
        os.environ.update({k: v for k, v in env.items() if k in ("LOOM_LAUNCH_TIME", "OMP_NUM_THREADS", "WANDB_MODE")})
        from loom.worker import run

        try:
            return run(run_dir)
        except Exception:
            return 1
    cmd = torchrun_command(cfg, run_dir)
    if multi_node(cfg):
        print(node_banner(cfg), flush=True)
        print(f"node {socket.gethostname()}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame) -> None:
        # torchrun handles SIGTERM (it stops its workers with it, and Loom's workers then
        # checkpoint and exit); SIGUSR1 would kill the agent outright, so it becomes SIGTERM.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if multi_node(cfg):
        print(f"node {socket.gethostname()}: torchrun exited with {rc}", flush=True)
    return rc
