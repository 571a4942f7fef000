"""Multi-node torchrun: two "nodes" on one machine, each its own `loom train` launcher.

Both launchers run the same command, as on two machines: their torchrun agents meet at a c10d
rendezvous on 127.0.0.1, train one run in one run dir (named by run.id), and global rank 0
writes the run's files. The nodes are CPU nodes: `hardware=cpu hardware.num_nodes=2` is the
multi-node profile for CPU machines (`hardware=multinode` is the same thing for H100 nodes).

The suite's uninterrupted two-node run is test_elastic_nodes' reference (an elastic range,
min_nodes=1 of 2, that both nodes join): it checks the one run dir, each launcher's banner and
summary, the per-rank memory and logs. Two fixed-size nodes losing one of them are
tests/test_kubernetes.py's pod simulation (two pods of a TrainJob, which replaced this file's
two-node run with a killed worker). Here: the refusals, the torchrun command and concurrent freezes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import refused


def test_multinode_needs_a_run_id_and_an_endpoint(tmp_path):
    err = refused(tmp_path, "hardware=cpu", "hardware.num_nodes=2", "hardware.rdzv_endpoint=127.0.0.1:29400")
    assert "run.id" in err and "byte-identical" in err, err
    err = refused(tmp_path, "hardware=multinode", "run.id=x")
    assert "hardware.rdzv_endpoint" in err, err
    assert not (tmp_path / "gpt").exists()


def test_elastic_min_nodes_and_rendezvous_command():
    from loom.errors import ConfigError
    from loom.launch import torchrun_command, worker_env
    from loom.pipeline import resolve

    cfg = resolve(["hardware=multinode", "hardware.rdzv_endpoint=node0:29400", "hardware.min_nodes=1",
                   "run.id=exp42"])
    cmd = torchrun_command(cfg, Path("/runs/exp42"))
    assert "--nnodes=1:2" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=node0:29400" in cmd and "--rdzv-id=exp42" in cmd
    assert worker_env(cfg)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    cfg = resolve(["hardware=multinode", "hardware.rdzv_endpoint=node0:29400", "run.id=exp42"])
    assert "--nnodes=2" in torchrun_command(cfg, Path("/r"))
    with pytest.raises(ConfigError, match="hardware.min_nodes"):
        resolve(["hardware=multinode", "hardware.rdzv_endpoint=node0:29400", "hardware.min_nodes=3"])


def test_nodes_freezing_the_same_run_at_once_agree(tmp_path):
    """Every node's launcher freezes the run dir at about the same time: none fails or refuses."""
    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan

    cfg = resolve(["hardware=cpu", "hardware.num_nodes=2", "hardware.rdzv_endpoint=n0:29400", "run.id=race",
                   f"run.root={tmp_path}"])
    results, errors = [], []

    def node() -> None:
        try:
            results.append(freeze(cfg, make_plan(cfg)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=node) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {r.state for r in results} <= {"new", "resume"} and len({r.run_dir for r in results}) == 1
    assert not list(results[0].run_dir.glob("*.tmp"))


def test_an_elastic_run_sizes_its_mesh_from_the_world_torchrun_formed():
    """min_nodes=1 of 2: with one node up, fsdp shards over that node's ranks (no HSDP
    replica dim sized from the profile's two nodes)."""
    from loom.pipeline import resolve
    from loom.strategies import build_strategy, layout_of

    cfg = resolve(["hardware=cpu", "hardware.devices=2", "hardware.num_nodes=2", "+hardware.min_nodes=1",
                   "hardware.rdzv_endpoint=node0:29400", "strategy=fsdp"])
    profile = layout_of(cfg)
    assert (profile.world, profile.dp_replicate, profile.dp_shard) == (4, 2, 2) and profile.hybrid
    formed = layout_of(cfg, world=2)  # what the worker passes: WORLD_SIZE from torchrun
    assert (formed.world, formed.num_nodes, formed.dp_replicate, formed.dp_shard) == (2, 1, 1, 2)
    strategy = build_strategy(cfg, formed)
    assert strategy._data_parallel_size == 2 and strategy._tensor_parallel_size == 1
    assert not strategy.loom_layout.hybrid


def test_the_agents_stderr_keeps_cpp_traces_off_the_console_and_says_a_restart(tmp_path):
    """What torch writes to the agent's stderr at a lost rank and at a multi-node shutdown: the
    C++ store trace goes to the log only; the failure and restart become one line of Loom's."""
    import io

    from loom.launch.console import StderrFilter

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "step-0000004.ckpt").write_bytes(b"x")
    (ckpts / "last.ckpt").symlink_to("step-0000004.ckpt")
    lines = [
        b"[W1123 22:29:11.220000000 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=7)\n",
        b"Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:670 "
        b"(most recent call first):\n",
        b"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in libc10.so)\n",
        b"E1123 22:29:12.000000 99 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        b"(exitcode: -9) local_rank: 1 (pid: 4242) of fn: forked_rank (start_method: forkserver)\n",
        b"I1123 22:29:12.100000 99 torch/distributed/elastic/agent/server/api.py:944] [default] Worker group "
        b"FAILED. 1/1 attempts left; will restart worker group\n",
        b"UserWarning: a library's own warning\n",
    ]
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.writelines(lines)
    console = io.StringIO()
    with os.fdopen(read, "rb") as pipe:
        f = StderrFilter(pipe, tmp_path / "logs" / "agent.log", console=console, run_dir=tmp_path).start()
        f.join()
    assert console.getvalue().splitlines() == [
        "loom: local rank 1 (pid 4242) was killed by SIGKILL: torchrun restarts this node's ranks "
        f"(1 of 1 restarts left); they resume from {ckpts / 'step-0000004.ckpt'}",
        "UserWarning: a library's own warning"]
    assert (tmp_path / "logs" / "agent.log").read_bytes() == b"".join(lines)  # the log keeps every line
