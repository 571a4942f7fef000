"""Elastic nodes: a node lost for good mid-run; the other node goes on alone; the node comes
back and the world grows back to two nodes; the run completes on the reference's curve.

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

The node then returns (the same command, started again): the survivor's agent sees a node
waiting at the rendezvous, stops its rank (SIGTERM: a checkpointed stop) and the world of two
re-forms and resumes from that checkpoint. So that the node returns while the world-1 attempt
still trains, the model (`HeldAtWorldOne`, written into the runs' root) holds a world-1
attempt after HOLD_AFTER micro-batches until the process is asked to stop, and says so with a
`<gate>.held1` file: the test starts the returning node once that file exists. (The model
is a tiny one, a whole run takes a second or two: it also holds the first attempt after step 4
until the test has killed the node, so the loss happens mid-run.)

Checked against an uninterrupted 2-node run of the same command (also the suite's two-node
run: test_kubernetes's pod simulation checks a fixed-size pair losing a node): every step's loss
within 1e-4 (the same math in another summation order), the same samples consumed (count, and
no step trained a sample the reference did not train at that step), world_history 2 -> 1 -> 2.
The timings are wide for a loaded machine: heartbeats every 2 s, a 15 s last call (both nodes
of the reference join at once: the round closes when the second joins, without waiting), a
60 s collective timeout (a dead peer's closed sockets fail the survivor's collective at once).
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
from conftest import FAST, LoomResult, alive, launching_fixture, start_loom

STEPS, EVERY, GBS = 20, 4, 4
HOLD_AFTER = EVERY  # training micro-batches of an attempt before it holds (2 a step at world 1)
TOL = 1e-4
ARGS = [*FAST, f"checkpoint.every_n_steps={EVERY}", f"trainer.max_steps={STEPS}", "dataset.batch_size=2",
        "dataset.seq_len=32", "hardware=cpu", "hardware.num_nodes=2", "hardware.devices=1", "hardware.min_nodes=1",
        "hardware.max_restarts=1", "hardware.timeout_train_s=60", "hardware.rdzv_keep_alive_s=2",
        "hardware.hang_timeout_s=0",  # the model holds a step on purpose while the test acts: no watchdog
        "hardware.rdzv_last_call_s=15", "model=custom", "model.module._target_=nodes_models.HeldAtWorldOne",
        f"+model.module.after={HOLD_AFTER}", "security.allow_targets=[nodes_models.]"]
MODELS = '''
import os
import signal
import time

import torch.distributed as dist
from tests_helpers import TinyTokenNet


def _asked_to_stop() -> bool:
    """Whether Loom's preemption handler (the SIGTERM handler of a training rank) was called."""
    saver = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return getattr(saver, "requested_signal", None) is not None


class HeldAtWorldOne(TinyTokenNet):
    """Holds a training forward where the test must act: at world 2, after `after` micro-batches
    until `<gate>.go2` exists (the test kills a node meanwhile); at world 1, after `after`
    micro-batches until it is asked to stop (the returning node restarts it). Each hold first
    creates `<gate>.held2` / `<gate>.held1`."""

    def __init__(self, gate: str, after: int) -> None:
        super().__init__()
        self.gate, self.after, self.calls = gate, after, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            world = dist.get_world_size() if dist.is_initialized() else 1
            if self.calls > self.after and not os.path.exists(f"{self.gate}.go{world}"):
                open(f"{self.gate}.held{world}", "a").close()
                while not os.path.exists(f"{self.gate}.go{world}") and not _asked_to_stop():
                    time.sleep(0.05)
        return super().forward(x)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(root: Path, rid: str, port: int, ids: Path) -> subprocess.Popen:
    """One node's launcher, in its own process group (as on its own machine)."""
    from tests_helpers import helpers_env

    env = {**helpers_env(root), "OMP_NUM_THREADS": "1", "LOOM_RECORD_SAMPLE_IDS": str(ids)}
    return start_loom("train", *ARGS, f"hardware.rdzv_endpoint=127.0.0.1:{port}", f"run.id={rid}",
                      f"+model.module.gate={root / ('gate-' + rid)}", root=root, env=env, start_new_session=True)


def _start_nodes(root: Path, rid: str, port: int, ids: Path) -> list[subprocess.Popen]:
    return [_start_node(root, rid, port, ids) for _ in range(2)]


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


def _wait(cond, what: str, nodes: list[subprocess.Popen], timeout: float = 300) -> None:
    """Until `cond()`, failing if a node's launcher exits first or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert all(p.poll() is None for p in nodes), f"a node exited before {what}:\n" + "\n".join(_outputs(nodes, 60))
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _lose_a_node(run_dir: Path, port: int, nodes: list[subprocess.Popen], gate: Path) -> dict:
    """Once the ranks hold after the step-4 checkpoint: SIGKILL the non-host node's launcher
    process group, then let the survivor go on (into a collective its peer will not join)."""
    _wait(Path(f"{gate}.held2").exists, "the world-2 hold", nodes)
    assert (run_dir / "checkpoints" / f"step-{EVERY:07d}.ckpt").exists()
    hosts = [_listens(_tree(p.pid), port) for p in nodes]
    assert sorted(hosts) == [False, True], hosts
    victim = nodes[hosts.index(False)]
    tree = _tree(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    Path(f"{gate}.go2").touch()
    return {"victim": victim, "tree": tree, "survivor": nodes[hosts.index(True)],
            "killed_at": json.loads((run_dir / "world_history.json").read_text())}


@launching_fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted 2-node reference, then the same command losing a node that comes back."""
    root = tmp_path_factory.mktemp("elastic_nodes")
    (root / "nodes_models.py").write_text(MODELS)
    out: dict = {"root": root}
    for world in (1, 2):  # the reference never holds
        (root / f"gate-ref.go{world}").touch()
    ref = _start_nodes(root, "ref", _free_port(), root / "ids-ref")
    out["ref_outs"] = _outputs(ref, 400)
    out["ref_rc"] = [p.returncode for p in ref]
    out["ref"] = LoomResult(0, "", "", root / "custom" / "ref")
    port, run_dir = _free_port(), root / "custom" / "lost"
    nodes = _start_nodes(root, "lost", port, root / "ids-lost")
    try:
        out.update(_lose_a_node(run_dir, port, nodes, root / "gate-lost"))
        survivor = out["survivor"]
        _wait((root / "gate-lost.held1").exists, "the world-1 hold", [survivor])
        out["world_one"] = json.loads((run_dir / "world_history.json").read_text())
        nodes.append(_start_node(root, "lost", port, root / "ids-back"))  # the node returns
    finally:
        outs = _outputs(nodes, 400)
    out["survivor_out"] = outs[nodes.index(out["survivor"])]
    out["back_out"], out["back_rc"] = outs[-1], nodes[-1].returncode
    out["run"] = LoomResult(out["survivor"].returncode, out["survivor_out"], "", run_dir)
    return out


def _who(attempt: dict) -> dict:
    """An attempt's identity (world_history.json also holds its span: end_step, samples, ...)."""
    return {k: attempt[k] for k in ("start_step", "world_size", "num_nodes", "reason")}


def _micro_batches(ids: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """Each rank file's (step, sample ids) lines, in order (LOOM_RECORD_SAMPLE_IDS)."""
    out = {}
    for f in sorted(ids.glob("rank-*.txt")):
        rows = [list(map(int, line.split())) for line in f.read_text().splitlines()]
        out[f.stem] = [(r[0], r[2:]) for r in rows]
    return out


@pytest.mark.slow
def test_reference_two_nodes_complete(runs):
    """Both launchers run the same command and train one run in one run dir (named by run.id);
    global rank 0 writes the run's files, each launcher says which node it is."""
    assert runs["ref_rc"] == [0, 0], "\n\n".join(runs["ref_outs"])
    run_dir = runs["ref"].run_dir
    s = runs["ref"].summary()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["num_nodes"] == 2 and s["restarts"] == 0
    assert [(h["world_size"], h["reason"]) for h in s["world_history"]] == [(2, "start")]
    for out in runs["ref_outs"]:
        assert "one of 1:2 node(s) x 1 process(es)" in out and "rendezvous at 127.0.0.1:" in out
        assert f"run dir: {run_dir}" in out and "completed" in out
    for key in ("peak_rss_gb_per_rank", "param_bytes_per_rank", "optim_state_bytes_per_rank"):
        assert len(s["memory"][key]) == 2, key
    assert sorted(x.name for x in (run_dir / "logs").glob("rank-*.log")) == ["rank-0.log", "rank-1.log"]
    assert (run_dir / "final" / "model.safetensors").exists() and not list(run_dir.glob("*.tmp"))


@pytest.mark.slow
def test_lost_node_leaves_the_survivor_alone_then_the_world_grows_back(runs):
    out = runs["survivor_out"]
    assert runs["victim"].returncode == -signal.SIGKILL
    assert [_who(h) for h in runs["killed_at"]] == [{"start_step": 0, "world_size": 2, "num_nodes": 2, "reason": "start"}]
    deadline = time.monotonic() + 60  # the launcher's death took its agent and rank down with it
    while any(alive(pid) for pid in runs["tree"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in runs["tree"] if alive(pid)], "the lost node's agent or rank lived on"
    # the survivor alone, from the last checkpoint, keeping the global batch
    (start, alone) = map(_who, runs["world_one"])
    resumed = alone["start_step"]
    assert start["world_size"] == 2 and resumed >= EVERY and resumed % EVERY == 0 and resumed < STEPS
    assert alone == {"start_step": resumed, "world_size": 1, "num_nodes": 1, "reason": "world change"}
    assert (f"World change: 2 -> 1 rank(s) on 1 node(s) from step {resumed}; trainer.accumulate_grad_batches 2 "
            f"keeps trainer.global_batch_size={GBS}") in out
    # the node came back: both launchers end with the completed run at world 2 again
    assert runs["run"].rc == 0, out
    assert runs["back_rc"] == 0, runs["back_out"]
    s = runs["run"].summary()
    assert s["status"] == "completed" and s["global_step"] == STEPS, out
    assert s["world_size"] == 2 and s["num_nodes"] == 2
    regrown = s["world_history"][-1]["start_step"]
    assert [_who(h) for h in s["world_history"]] == [
        {"start_step": 0, "world_size": 2, "num_nodes": 2, "reason": "start"},
        {"start_step": resumed, "world_size": 1, "num_nodes": 1, "reason": "world change"},
        {"start_step": regrown, "world_size": 2, "num_nodes": 2, "reason": "world change"}], s["world_history"]
    assert resumed < regrown < STEPS and s["resumed_from_step"] == regrown
    assert f"World change: 1 -> 2 rank(s) on 2 node(s) from step {regrown}" in out
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
    assert ref.summary()["samples"] == STEPS * GBS
    # the lost run's totals add up its attempts: the steps after its last checkpoint twice
    s = run.summary()
    assert s["samples"] == s["steps_trained"] * GBS and s["steps_trained"] >= STEPS
    assert s["steps_trained"] == sum(a["end_step"] - a["start_step"] for a in s["attempts"])
    # Every micro batch any attempt of any node trained at step k holds samples of the
    # reference's step k (no shifted sample), and the attempts together trained all of them.
    expected: dict[int, list[int]] = defaultdict(list)
    for rows in _micro_batches(runs["root"] / "ids-ref").values():
        for step, ids in rows:
            expected[step] += ids
    trained: dict[int, set[int]] = defaultdict(set)
    for d in ("ids-lost", "ids-back"):
        for rows in _micro_batches(runs["root"] / d).values():
            for step, ids in rows:
                assert set(ids) <= set(expected[step]), (d, step, ids, expected[step])
                trained[step] |= set(ids)
    assert all(len(v) == GBS for v in expected.values())
    assert {k: sorted(v) for k, v in trained.items()} == {k: sorted(v) for k, v in expected.items()}
    print(f"loss difference at most {worst:.2e}; world_history "
          f"{[(h['world_size'], h['start_step']) for h in run.summary()['world_history']]}")


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
