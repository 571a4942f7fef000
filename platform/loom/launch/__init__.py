"""Stage 5, launch: start the ranks of a frozen run: in-process for one process, torchrun for more.

torchrun's elastic agent (torch.distributed.run, through `loom.worker.agent`, which forks the
ranks from a forkserver that has their imports done) is started as a child process so the
launcher stays free of torch, and restarts (`--max-restarts`) re-run the same worker on
the same run dir, which then resumes from its last checkpoint.

Multi-node: every node runs the same `loom train` command; each launcher starts one torchrun
agent, and the agents meet at the c10d rendezvous `hardware.rdzv_endpoint` (hosted by the agent
on that host). torchrun assigns node ranks there, so a launcher knows its node only by name.
All nodes share one run dir (named by `run.id`, on storage every node sees); global rank 0
writes the run-level files. SLURM (`hardware.launcher=slurm`) starts the same torchrun command
on every node from a rendered sbatch script instead: see `loom.launch.slurm`.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from loom.hardware.checks import elastic
from loom.hardware.machine import usable_cores
from loom.launch.console import StderrFilter, agent_log
from loom.layout import ParallelLayout
from loom.rundir.paths import RunDir


def nnodes(cfg: DictConfig) -> str:
    """torchrun's --nnodes: `N`, or `MIN:N` for an elastic run (hardware.min_nodes)."""
    hw = cfg.hardware
    return f"{hw.min_nodes}:{hw.num_nodes}" if elastic(hw) else str(hw.num_nodes)


def torchrun_command(cfg: DictConfig, run_dir: Path | str, endpoint: str | None = None,
                     python: str = sys.executable) -> list[str]:
    """The torchrun command line of one node: torchrun's options to loom.worker.agent (torchrun's
agent, forking the ranks from a forkserver that has their imports done). `endpoint` overrides hardware.rdzv_endpoint (the
    SLURM script passes its first node); with neither, and one node, a standalone rendezvous."""
    hw = cfg.hardware
    endpoint = endpoint or hw.rdzv_endpoint
    cmd = [
        python, "-m", "loom.worker.agent",
        f"--nproc-per-node={hw.devices}",
        f"--nnodes={nnodes(cfg)}",
        f"--max-restarts={hw.max_restarts}",
    ]
    if hw.num_nodes == 1 and not endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={cfg.run.id}"]
        if elastic(hw):
            cmd.append(rdzv_conf(hw))
    return [*cmd, str(run_dir)]


def rdzv_conf(hw: DictConfig) -> str:
    """torchrun's --rdzv-conf of an elastic run. After a node is lost, the survivors' next round
    waits until the lost node's heartbeats are 3 keep-alives old and then a last call for late
    nodes: with torch's defaults (5 s x 3, 30 s) about 45 s with nothing training, which
    hardware.rdzv_keep_alive_s / rdzv_last_call_s shorten (or lengthen, for slow-to-join nodes)."""
    return (f"--rdzv-conf=last_call_timeout={hw.rdzv_last_call_s},keep_alive_interval={hw.rdzv_keep_alive_s},"
            "keep_alive_max_attempt=3")


def multi_node(cfg: DictConfig) -> bool:
    return cfg.hardware.num_nodes > 1 or (cfg.hardware.get("min_nodes") or 1) > 1


# Flight-recorder entries each rank keeps (collectives, with stack and state) for the dump.
NCCL_TRACE_ENTRIES = 20000


def gpu_env(cfg: DictConfig, run_dir: Path | str | None) -> dict[str, str]:
    """Environment defaults of GPU ranks (none on CPU), as torchtitan sets them: NCCL errors and
    timeouts abort the process (so torchrun restarts the job instead of a hang), the flight
    recorder dumps every rank's last collectives into `<run>/logs/nccl_trace_rank_<N>` on a
    timeout, and the caching allocator grows segments instead of fragmenting. A key the user
    already set wins (`worker_env` only fills what is missing)."""
    if cfg.hardware.accelerator != "gpu":
        return {}
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",   # abort the communicator and the process on error
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    if run_dir is not None:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(RunDir(run_dir).nccl_trace)
    return env


def worker_env(cfg: DictConfig, run_dir: Path | str | None = None) -> dict[str, str]:
    """The ranks' environment: this process's, plus Loom's defaults where the user set none."""
    env = dict(os.environ)
    env["LOOM_LAUNCH_TIME"] = str(time.time())
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // cfg.hardware.devices)))
    env.setdefault("WANDB_MODE", "offline")
    for key, value in gpu_env(cfg, run_dir).items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    # How long torchrun waits for SIGTERMed workers (saving their checkpoint) before SIGKILL (30 s).
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    if multi_node(cfg):
        # Without this, the rank-0 agent hosts one worker store for every rendezvous round, and
        # loom.worker.distributed keys it by the restart count, which differs between nodes (a node
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


def launch(cfg: DictConfig, layout: ParallelLayout, run_dir: Path) -> int:
    """Run all ranks to the end; returns the exit code of the training. Meanwhile the launcher
    is titled `loom[<run id>] launcher` (ps, `pgrep -f`; an in-process run's `..., rank 0/1`)."""
    from loom import process

    role = "launcher" if layout.world > 1 else "launcher, rank 0/1"
    with process.titled(process.title(str(cfg.run.id), role), "loom-launcher"):
        return _launch(cfg, layout, run_dir)


def _launch(cfg: DictConfig, layout: ParallelLayout, run_dir: Path) -> int:
    from loom.compose.hydra_options import launcher_debug

    env = worker_env(cfg, run_dir)
    launcher_debug(lambda: f"launch: {'in-process (1 rank)' if layout.world == 1 else shlex.join(torchrun_command(cfg, run_dir))}"
                   f"; environment set for the ranks: "
                   f"{ {k: v for k, v in env.items() if os.environ.get(k) != v and k != 'LOOM_LAUNCH_TIME'} }")
    if layout.world == 1:
        # In-process: CUDA is not initialized yet here, so the allocator setting still applies.
        keep = ("LOOM_LAUNCH_TIME", "OMP_NUM_THREADS", "WANDB_MODE", *gpu_env(cfg, run_dir))
        from loom.worker.main import run

        with rank_environment({k: v for k, v in env.items() if k in keep}):
            try:  # run() records its own failures; SIGINT/SIGTERM are a checkpointed stop (loom.worker.fit)
                return run(run_dir)
            except (Exception, KeyboardInterrupt):  # before the rank could record anything (Ctrl-C at startup)
                return 1
    cmd = torchrun_command(cfg, run_dir)
    if multi_node(cfg):
        print(node_banner(cfg), flush=True)
        print(f"node {socket.gethostname()}: {shlex.join(cmd)}", flush=True)
    rc = _run_agent(cmd, env, run_dir)
    if multi_node(cfg):
        print(f"node {socket.gethostname()}: torchrun exited with {rc}", flush=True)
    return rc


@contextmanager
def rank_environment(values: dict[str, str]) -> Iterator[None]:
    """The in-process rank's environment, and this process's own back afterwards. The rank sets
    OMP_NUM_THREADS to every core (one process), and Lightning and the libraries it loads set
    more: left behind, the next run this launcher starts (a sweep's next trial, a test's next
    launch) would give each of its ranks that many threads, oversubscribing the cores and
    changing CPU sums (a 4-rank run with 2 threads per rank ends ~1e-6 off the 1-thread run)."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _die_with_launcher() -> None:
    """In the agent, before exec: SIGKILL when the launcher dies, so a killed launcher, whose
    run-dir lock is then gone, leaves no run training behind it: the agent goes at once, its
    forkserver and ranks with it (loom.worker.main.die_with_parent), as a failed machine's would,
    and a relaunch resumes from the last checkpoint (it waits for any rank still alive:
    loom.rundir.lock.wait_for_ranks). An elastic run's other nodes' ranks then fail, their agents
    restart them and the rendezvous re-forms a smaller world. A checkpointed stop of the whole run
    is SIGTERM or Ctrl-C to the launcher (`_run_agent` passes it on)."""
    from loom.process import die_with_parent

    die_with_parent(signal.SIGKILL)


def _run_agent(cmd: list[str], env: dict[str, str], run_dir: Path) -> int:
    """torchrun in its own session (the terminal's Ctrl-C reaches the launcher only, which stops
    the agent once, with SIGTERM: its workers save a checkpoint at the next step boundary and
    exit, `preempted`), its stderr through `StderrFilter` (no agent traceback on the console);
    SIGKILL if the launcher dies (`_die_with_launcher`)."""
    linux = sys.platform.startswith("linux")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_die_with_launcher if linux else None)
    output = StderrFilter(proc.stderr, agent_log(run_dir), run_dir=run_dir).start()
    stopping: list[int] = []

    def forward(signum, frame) -> None:
        # torchrun handles SIGTERM (it stops its workers with it, and Loom's workers then
        # checkpoint and exit); SIGUSR1 would kill the agent outright, so it becomes SIGTERM.
        # Once: a second SIGTERM would make the agent abandon its workers mid-checkpoint.
        if stopping:
            print(f"loom: already stopping: the ranks are saving a checkpoint (kill -9 {proc.pid} aborts)",
                  file=sys.stderr, flush=True)
        elif proc.poll() is None:
            stopping.append(signum)
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    output.join()
    return rc
