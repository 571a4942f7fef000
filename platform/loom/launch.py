"""Start the ranks of a frozen run: in-process for one process, torchrun for more.

torchrun (torch.distributed.run, the elastic agent) is started as a child process so the
launcher stays free of torch, and restarts (`--max-restarts`) re-run the same worker on
the same run dir, which then resumes from its last checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig


def torchrun_command(cfg: DictConfig, run_dir: Path) -> list[str]:
    hw = cfg.hardware
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={hw.devices}",
        f"--nnodes={hw.num_nodes}",
        f"--max-restarts={hw.max_restarts}",
        "--monitor-interval=0.5",
    ]
    if hw.num_nodes == 1 and not hw.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={hw.rdzv_endpoint}", f"--rdzv-id={cfg.run.id}"]
    return [*cmd, "-m", "loom.worker", str(run_dir)]


def worker_env(cfg: DictConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["LOOM_LAUNCH_TIME"] = str(time.time())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // cfg.hardware.devices)))
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    proc = subprocess.Popen(torchrun_command(cfg, run_dir), env=env)

    def forward(signum, frame) -> None:
        # torchrun handles SIGTERM (it stops its workers with it, and Loom's workers then
        # checkpoint and exit); SIGUSR1 would kill the agent outright, so it becomes SIGTERM.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
