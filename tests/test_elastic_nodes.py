"""Elastic nodes: a node lost for good mid-run; the other node goes on alone and completes the run.

Two loopback "nodes" (one `loom train` launcher each, 1 process per node, hardware.min_nodes=1)
train one run. Once its step-4 checkpoint exists, the node that does not host the c10d
rendezvous (its torchrun agent must survive; see LESSONS "Elastic") loses its launcher's process
group to SIGKILL. The launcher's death takes the node's agent and rank down at once (SIGKILL
through their parent-death signals: an elastic run's node dies like a machine, it does not stop
the run with a checkpoint). The survivor's rank then fails on its next collective, its agent
restarts it (hardware.max_restarts=1), the rendezvous re-forms a world of one node (the lost
node's heartbeats expire after 3 x hardware.rdzv_keep_alive_s, then a last call of
hardware.rdzv_last_call_s), and the rank resumes from the last checkpoint at world 1 with the
accumulation doubled, keeping trainer.global_batch_size=4.

Checked against an uninterrupted 2-node run of the same command: every step's loss within 1e-4
(the same math in another summation order), the same samples consumed (count, and each step's
samples after the change), and world_history 2 -> 1. The last call must also let both nodes
join the first round (both launchers start together), so it is 5 s, not 1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import FAST, LOOM, LoomResult, launching_fixture

STEPS, EVERY, GBS = 20, 4, 4
TOL = 1e-4
ARGS = [*FAST, f"checkpoint.every_n_steps={EVERY}", f"trainer.max_steps={STEPS}", "dataset.batch_size=2",
        "dataset.seq_len=32", "hardware=cpu", "hardware.num_nodes=2", "hardware.devices=1", "hardware.min_nodes=1",
        "hardware.max_restarts=1", "hardware.timeout_train_s=10", "hardware.rdzv_keep_alive_s=1",
        "hardware.rdzv_last_call_s=5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(root: Path, rid: str, port: int, ids: Path) -> list[subprocess.Popen]:
    """Both nodes' launchers at once, each in its own process group (as on its own machine)."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "LOOM_RECORD_SAMPLE_IDS": str(ids)}
    cmd = [*LOOM, "train", *ARGS, f"hardware.rdzv_endpoint=127.0.0.1:{port}", f"run.id={rid}", f"run.root={root}"]
    return [subprocess.Popen(cmd, cwd=root, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True) for _ in range(2)]


def _outputs(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the launcher, its torchrun agent, the agent's ranks)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children[int(fields[1])].append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children[out[-1]]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _listens(pids: list[int], port: int) -> bool:
    """Whether one of `pids` holds the listening socket of `port` (hosts the rendezvous store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":
                inodes.add(f"socket:[{f[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                if os.readlink(fd) in inodes:
                    return True
            except OSError:
                continue
    return False


def _lose_a_node(run_dir: Path, port: int, nodes: list[subprocess.Popen]) -> dict:
    """After the step-4 checkpoint: SIGKILL the non-host node's launcher process group."""
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / f"step-{EVERY:07d}.ckpt").exists():
        assert all(p.poll() is None for p in nodes), "a node exited early:\n" + "\n".join(_outputs(nodes, 60))
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.01)
    hosts = [_listens(_tree(p.pid), port) for p in nodes]
    assert sorted(hosts) == [False, True], hosts
    victim = nodes[hosts.index(False)]
    tree = _tree(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    return {"victim": victim, "tree": tree, "survivor": nodes[hosts.index(True)],
            "killed_at": json.loads((run_dir / "world_history.json").read_text())}


@launching_fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted 2-node reference, then the same command losing a node."""
    root = tmp_path_factory.mktemp("elastic_nodes")
    out: dict = {"root": root}
    t0 = time.monotonic()
    ref = _start_nodes(root, "ref", _free_port(), root / "ids-ref")
    out["ref_outs"] = _outputs(ref, 240)
    out["ref_rc"] = [p.returncode for p in ref]
    out["ref"] = LoomResult(0, "", "", root / "gpt" / "ref")
    t1 = time.monotonic()
    port, run_dir = _free_port(), root / "gpt" / "lost"
    nodes = _start_nodes(root, "lost", port, root / "ids-lost")
    try:
        out.update(_lose_a_node(run_dir, port, nodes))
    finally:
        outs = _outputs(nodes, 240)
    out["survivor_out"] = outs[nodes.index(out["survivor"])]
    out["run"] = LoomResult(out["survivor"].returncode, out["survivor_out"], "", run_dir)
    print(f"reference {t1 - t0:.1f} s, node lost {time.monotonic() - t1:.1f} s")
    return out


def _micro_batches(ids: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """Each rank file's (step, sample ids) lines, in order (LOOM_RECORD_SAMPLE_IDS)."""
    out = {}
    for f in sorted(ids.glob("rank-*.txt")):
        rows = [list(map(int, line.split())) for line in f.read_text().splitlines()]
        out[f.stem] = [(r[0], r[2:]) for r in rows]
    return out


@pytest.mark.slow
def test_reference_two_nodes_complete(runs):
    assert runs["ref_rc"] == [0, 0], "\n\n".join(runs["ref_outs"])
    s = runs["ref"].summary()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["restarts"] == 0
    assert [(h["world_size"], h["reason"]) for h in s["world_history"]] == [(2, "start")]


@pytest.mark.slow
def test_lost_node_leaves_the_survivor_to_complete_the_run_alone(runs):
    out = runs["survivor_out"]
    assert runs["victim"].returncode == -signal.SIGKILL
    assert runs["killed_at"] == [{"start_step": 0, "world_size": 2, "num_nodes": 2, "reason": "start"}]
    deadline = time.monotonic() + 10  # the launcher's death took its agent and rank down with it
    while any(_alive(pid) for pid in runs["tree"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in runs["tree"] if _alive(pid)], "the lost node's agent or rank lived on"
    assert runs["run"].rc == 0, out
    s = runs["run"].summary()
    assert s["status"] == "completed" and s["global_step"] == STEPS, out
    assert s["world_size"] == 1 and s["num_nodes"] == 1 and s["restarts"] == 1
    resumed = s["resumed_from_step"]
    assert resumed is not None and resumed >= EVERY and resumed % EVERY == 0 and resumed < STEPS
    assert s["world_history"] == [
        {"start_step": 0, "world_size": 2, "num_nodes": 2, "reason": "start"},
        {"start_step": resumed, "world_size": 1, "num_nodes": 1, "reason": "world change"}]
    # the surviving node's launcher says what happened
    assert (f"World change: 2 -> 1 rank(s) on 1 node(s) from step {resumed}; trainer.accumulate_grad_batches 2 "
            f"keeps trainer.global_batch_size={GBS}") in out
    assert "loom run lost: completed" in out and "world history" in out  # a row of the summary table


@pytest.mark.slow
def test_lost_node_run_matches_the_uninterrupted_one(runs):
    ref, run = runs["ref"], runs["run"]
    assert run.rc == 0 and runs["ref_rc"] == [0, 0]
    la, lb = ref.losses(), run.losses()
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    worst = max(abs(la[k] - lb[k]) for k in la)
    assert worst < TOL, (worst, la, lb)
    assert abs(ref.summary()["final_loss"] - run.summary()["final_loss"]) < TOL
    assert run.summary()["samples"] == ref.summary()["samples"] == STEPS * GBS
    # After the change the survivor alone writes rank-0.txt: its last lines are the world-1
    # attempt's micro batches (2 per step); each step trained exactly the reference's samples.
    resumed = run.summary()["resumed_from_step"]
    expected: dict[int, list[int]] = defaultdict(list)
    for rows in _micro_batches(runs["root"] / "ids-ref").values():
        for step, ids in rows:
            expected[step] += ids
    tail = _micro_batches(runs["root"] / "ids-lost")["rank-0"][-2 * (STEPS - resumed):]
    trained: dict[int, list[int]] = defaultdict(list)
    for step, ids in tail:
        trained[step] += ids
    assert sorted(trained) == list(range(resumed + 1, STEPS + 1))
    assert all(sorted(trained[k]) == sorted(expected[k]) and len(trained[k]) == GBS for k in trained)
    print(f"loss difference at most {worst:.2e}; resumed at step {resumed}; world_history "
          f"{[(h['world_size'], h['reason']) for h in run.summary()['world_history']]}")


def test_elastic_rendezvous_timings_reach_torchrun_and_do_not_change_the_run():
    """hardware.min_nodes and the rendezvous timings are plain overrides (hardware=cpu's YAML has
    neither key); only an elastic range passes --rdzv-conf; the timings are launch settings, not
    part of the run (its automatic id stays, so a relaunch with other timings resumes it)."""
    from loom.errors import ConfigError
    from loom.freeze import run_id
    from loom.launch import torchrun_command
    from loom.pipeline import resolve

    base = ["hardware=cpu", "hardware.num_nodes=2", "hardware.devices=1", "hardware.rdzv_endpoint=n0:29400"]
    cfg = resolve([*base, "hardware.min_nodes=1", "hardware.rdzv_keep_alive_s=1", "hardware.rdzv_last_call_s=5",
                   "hardware.timeout_train_s=10", "run.id=x"])
    cmd = torchrun_command(cfg, "/r")
    assert "--nnodes=1:2" in cmd and cfg.hardware.timeout_train_s == 10
    assert "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3" in cmd
    fixed = torchrun_command(resolve([*base, "run.id=x"]), "/r")
    assert "--nnodes=2" in fixed and not [a for a in fixed if a.startswith("--rdzv-conf")]
    default = resolve([*base, "hardware.min_nodes=1"])
    assert run_id(default) == run_id(resolve([*base, "hardware.min_nodes=1", "hardware.rdzv_last_call_s=2"]))
    assert "--rdzv-conf=last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3" in torchrun_command(
        default, "/r")
    with pytest.raises(ConfigError, match="hardware.rdzv_keep_alive_s"):
        resolve([*base, "hardware.rdzv_keep_alive_s=0"])
    with pytest.raises(ConfigError, match="unknown key hardware.min_node=1"):
        resolve([*base, "hardware.min_node=1"])
