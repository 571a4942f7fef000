"""A run's lifecycle with real processes: one launcher per run dir, deterministic failures
reported in one paragraph without a restart, and Ctrl-C as a checkpointed stop (exit 143).

The models are written into the runs' root (the launcher's and the ranks' working directory,
on `python -m`'s path): `Gated` trains digits and holds every step after the first until a gate
file exists, so a test decides when a run may go on; `Broken` raises in its constructor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import refused, run_loom, start_loom

MODELS = '''
import os
import signal
import time

import pytorch_lightning as pl
import torch.nn.functional as F
from torch import nn


def _asked_to_stop() -> bool:
    """Whether Loom's preemption handler (the SIGINT/SIGTERM handler of a training run) was called."""
    saver = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    return getattr(saver, "requested_signal", None) is not None


class Gated(pl.LightningModule):
    """A digits classifier whose steps after the first wait for the file `gate`, or for the
    run to be asked to stop (then the step ends and the run stops at its boundary)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)
        self.gate = gate

    def training_step(self, batch, batch_idx):
        while self.global_step >= 1 and not os.path.exists(self.gate) and not _asked_to_stop():
            time.sleep(0.05)
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class Broken(nn.Module):
    """A code error only the first forward finds: its input width is not the data's (64)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Linear(width, 10)

    def forward(self, x):
        return self.net(x)
'''
# No torch at import: validation binds the arguments of `make_net` in well under a second.
FACTORY = "def make_net(width: int = 16):\n    from torch import nn\n\n    return nn.Linear(width, width)\n"

STEPS = 6
BASE = ["tracking=csv", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=0", "dataset=digits",
        "model=custom", "security.allow_targets=[lifecycle_models.,lifecycle_factory.]",
        f"trainer.max_steps={STEPS}"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "lifecycle_models.py").write_text(MODELS)
    (tmp_path / "lifecycle_factory.py").write_text(FACTORY)
    return tmp_path


def _gated(root: Path, run_id: str) -> list[str]:
    return [*BASE, "strategy=single", "model.module._target_=lifecycle_models.Gated",
            f"+model.module.gate={root / ('gate-' + run_id)}", f"run.id={run_id}"]


def _start(root: Path, args: list[str]) -> subprocess.Popen:
    """`loom train` in the background, in its own process group (as a terminal's job)."""
    return start_loom("train", *args, root=root, merge_stderr=False, start_new_session=True)


def _wait_for_step_1(proc: subprocess.Popen, timeout: float = 150) -> str:
    """Read the launcher's output until step 1 is logged (the run holds at step 2's gate)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"exited early ({proc.wait()}): {''.join(seen)}{proc.stderr.read()}"
        seen.append(line)
        if line.startswith(f"step 1/{STEPS}"):
            return "".join(seen)
    raise AssertionError(f"no step 1 within {timeout} s: {''.join(seen)}")


def _steps(run_dir: Path) -> list[int]:
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def test_run_lock_is_exclusive_shared_for_nodes_and_freed_by_the_kernel(tmp_path, capfd):
    """A holder in another process refuses an exclusive and a shared taker, naming its pid; two
    nodes' shared locks coexist; a holder killed with -9 leaves a stale record, taken over."""
    from loom.errors import ConfigError
    from loom.rundir.lock import run_lock

    def holder(shared: bool) -> subprocess.Popen:
        code = (f"import sys\nfrom loom.rundir.lock import run_lock\nwith run_lock({str(tmp_path)!r}, 'r', "
                f"shared={shared}):\n    print('held', flush=True)\n    sys.stdin.readline()\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        return p

    exclusive = holder(shared=False)
    for shared in (False, True):
        with pytest.raises(ConfigError) as e, run_lock(tmp_path, "r", shared=shared):
            pass
        assert f"pid {exclusive.pid}" in str(e.value) and "tail -f" in str(e.value)
    exclusive.kill()
    exclusive.wait()
    with run_lock(tmp_path, "r"):  # the kernel freed it; the dead holder's record is reported
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert f"pid {exclusive.pid}" in capfd.readouterr().err
    assert (tmp_path / ".lock").read_text() == ""  # released cleanly: nothing stale for the next one

    node = holder(shared=True)  # a node of a multi-node run: a single-node launch is refused ...
    with pytest.raises(ConfigError, match=f"pid {node.pid}"), run_lock(tmp_path, "r"):
        pass
    with run_lock(tmp_path, "r", shared=True):  # ... and another node of the same run joins it
        pass
    node.communicate("\n")


def test_a_launcher_waits_for_the_ranks_of_an_earlier_launch_and_names_them(tmp_path, capfd):
    """Ranks hold `.ranks.lock` shared for their life: a launcher taking the run waits until the last
    one is gone (saying so once, naming them), and refuses with their pids if they outlive the wait."""
    from loom.errors import ConfigError
    from loom.rundir.lock import rank_lock, wait_for_ranks

    def rank(n: int, lives: float | None) -> subprocess.Popen:
        body = "sys.stdin.readline()" if lives is None else f"time.sleep({lives})"
        code = (f"import sys, time\nfrom loom.rundir.lock import rank_lock\nwith rank_lock({str(tmp_path)!r}, {n}):\n"
                f"    print('held', flush=True)\n    {body}\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        return p

    wait_for_ranks(tmp_path, "r")  # no rank ever: no file, no wait
    stuck = [rank(0, None), rank(1, None)]
    with pytest.raises(ConfigError) as e:
        wait_for_ranks(tmp_path, "r", timeout=0.5)
    assert all(f"pid {p.pid}" in str(e.value) for p in stuck) and f"kill {stuck[0].pid} {stuck[1].pid}" in str(e.value)
    for p in stuck:
        p.communicate("\n")
    capfd.readouterr()
    leaving = rank(0, 1.5)
    t0 = time.monotonic()
    wait_for_ranks(tmp_path, "r", timeout=60)
    assert leaving.poll() is not None and time.monotonic() - t0 > 0.5  # it waited for the rank to exit
    err = capfd.readouterr().err
    assert err.count("waiting for the ranks of an earlier launch of run r to exit") == 1 and f"pid {leaving.pid}" in err
    assert (tmp_path / ".ranks.lock").read_text() == ""  # the dead ranks' records cleared
    with rank_lock(tmp_path, 0):  # a rank of this process does not block its own launcher's next check
        pass
    wait_for_ranks(tmp_path, "r", timeout=0.5)


@pytest.mark.launch
@pytest.mark.slow
def test_a_second_launch_is_refused_and_sigint_checkpoints_exits_143_and_the_same_command_resumes(root):
    """One gated 1-process run, held after step 1: the same command launched again meanwhile
    exits 2 naming the running launcher; Ctrl-C then stops the first at a checkpoint (exit 143,
    two lines, no traceback; the gate lets the held step end once the signal arrived, no
    sleep); the same command resumes it to the end, no step written twice."""
    args = _gated(root, "ctrlc")
    run = _start(root, args)
    try:
        _wait_for_step_1(run)
        second = run_loom("train", *args, root=root, timeout=600)
        assert second.rc == 2, second.out + second.err
        assert f"pid {run.pid}" in second.err and "tail -f" in second.err and "rank-0.log" in second.err
        assert "Traceback" not in second.err and "Resuming" not in second.out
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground job
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 143, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    message = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert len(message) == 2 and "checkpoint was saved" in message[0] and "same command" in message[1], err
    run_dir = root / "custom" / "ctrlc"
    s = json.loads((run_dir / "summary.json").read_text())
    stopped = s["global_step"]
    assert s["status"] == "preempted" and stopped in (1, 2)  # the signal may beat step 1's boundary
    assert (run_dir / "checkpoints" / f"step-{stopped:07d}.ckpt").exists()
    assert (run_dir / "logs" / "rank-0.log").read_text().count("started, attempt") == 1  # not by the second

    (root / "gate-ctrlc").touch()  # the resumed run trains straight on
    again = run_loom("train", *args, root=root, timeout=600)
    assert again.rc == 0 and "Resuming run ctrlc" in again.out, again.out + again.err
    s = again.summary()
    assert s["status"] == "completed" and s["resumed_from_step"] == stopped and s["global_step"] == STEPS
    assert s["error"] is None
    assert _steps(run_dir) == list(range(1, STEPS + 1))


def test_a_typo_in_a_constructor_argument_is_refused_at_validation(root, loom):
    err = refused(root, *BASE, "model.module._target_=lifecycle_factory.make_net",
                       "+model.module.widht=32")
    assert "model.module.widht" in err and "did you mean 'width'" in err and "accepts: width" in err


@pytest.mark.launch
@pytest.mark.slow
def test_a_worker_error_before_step_1_is_one_paragraph_without_a_restart(root):
    """2 processes under torchrun (hardware=cpu allows one restart): both ranks raise torch's
    shape-mismatch RuntimeError in the first forward (a code error, not a flaky one); exit 1
    after one attempt, the console holds one paragraph. (The other classes: test below.)"""
    r = run_loom("train", *BASE, "hardware=cpu", "hardware.max_restarts=1",
                 "model.module._target_=lifecycle_models.Broken", "run.id=broken", root=root, timeout=600)
    assert r.rc == 1, r.out + r.err
    assert "Traceback" not in r.out + r.err and "ChildFailedError" not in r.err
    paragraph = [line for line in r.err.splitlines() if not line.startswith("warning:")]
    assert len(paragraph) == 1, r.err
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in paragraph[0], paragraph[0]
    assert "rank 0" in paragraph[0] or "rank 1" in paragraph[0]
    assert "lifecycle_models.py:" in paragraph[0] and "Not restarted" in paragraph[0]
    logs = r.run_dir / "logs"
    assert f"Full traceback: {logs / 'rank-0.log'}" in paragraph[0]
    error = r.summary()["error"]
    assert r.summary()["status"] == "failed"
    assert error["type"] == "RuntimeError" and error["step"] == 0
    assert "shapes cannot be multiplied" in error["message"] and error["log"] == str(logs / f"rank-{error['rank']}.log")
    for rank in (0, 1):  # one attempt per rank, its traceback in its own log
        text = (logs / f"rank-{rank}.log").read_text()
        assert text.count("started, attempt") == 1 and "attempt 1" not in text
        assert "Traceback" in text and "RuntimeError" in text


@pytest.mark.parametrize(("exc", "code_error"), [
    (TypeError("width=16 must be a multiple of 64"), True),
    (ValueError("dataset tinycode: the training split has fewer than seq_len+1=65 tokens"), True),
    # transformers' init indexing a ZeRO-3 partition (issue 35: it was restarted once before failing)
    (IndexError("index 0 is out of bounds for dimension 0 with size 0"), True),
    (KeyError("model.layers.0.mlp.up_proj.weight"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 16x10)"), True),
    (RuntimeError("The size of tensor a (64) must match the size of tensor b (32) at non-singleton dimension 1"),
     True),
    # transformers' from_pretrained into ZeRO-3's empty partitions (weights of another shape)
    (RuntimeError("You set `ignore_mismatched_sizes` to `False`, thus raising an error. For details look at the "
                  "above report!"), True),
    (RuntimeError("expected scalar type Float but found Half"), True),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error, dimension 3"), False),
    (RuntimeError("Connection closed by peer [127.0.0.1]:29500"), False),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
])
def test_a_failure_is_restarted_only_if_it_may_pass_next_time(tmp_path, monkeypatch, exc, code_error):
    """A code error (config-like types, IndexError, a tensor shape or dtype that does not fit)
    exits 0 under torchrun (no restart, the record says why), before the first step or at any
    later one (a restart resumes onto the same batches); a communication or memory error exits
    1 (restart)."""
    from loom.rundir.failures import failure_paragraph, read_failures
    from loom.worker.failure import Progress, record_failure

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "logs").mkdir()
    rc = record_failure(tmp_path, 0, exc, Progress())
    assert rc == (0 if code_error else 1)
    record = read_failures(tmp_path, 0)[-1]
    assert record["deterministic"] is code_error and record["type"] == type(exc).__name__
    at_step_5 = Progress(trainer=type("T", (), {"global_step": 5})())
    assert record_failure(tmp_path, 0, exc, at_step_5) == (0 if code_error else 1)
    record = read_failures(tmp_path, 0)[-1]
    assert record["step"] == 5 and record["before_first_step"] is False and record["deterministic"] is code_error
    paragraph = failure_paragraph(record)
    assert "at step 5" in paragraph and ("Not restarted" in paragraph) is code_error, paragraph
