"""A hung run says where every rank stood: hardware.hang_timeout_s, the watchdog in every rank
(loom.worker.hang), the launcher's one paragraph and summary.json `error.type: hang`.

One launch of its own (2 ranks, the digits classifier): rank 1 blocks forever in training_step
at step 5; rank 0 then waits in backward for the gradients' all-reduce."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, launching_fixture, refused, run_loom
from tests_helpers import helpers_env

pytestmark = pytest.mark.slow

HANG = [*(o for o in FAST if not o.startswith(("dataset.", "checkpoint."))), "dataset=digits", "model=custom",
        "model.module._target_=tests_helpers.HangLit", "security.allow_targets=[tests_helpers.]",
        "hardware=cpu", "hardware.devices=2", "trainer.max_steps=8", "checkpoint.every_n_steps=2",
        "hardware.hang_timeout_s=5", "hardware.max_restarts=0", "run.id=hang"]


@launching_fixture(scope="module")
def hung(tmp_path_factory):
    root = tmp_path_factory.mktemp("hang")
    return run_loom("train", *HANG, root=root, env=helpers_env(root), timeout=600)


def test_the_launcher_says_where_each_rank_hung(hung):
    assert hung.rc == 1, hung.out + hung.err
    lines = [line for line in (hung.out + hung.err).splitlines() if line.startswith("Training hung:")]
    assert len(lines) == 1, hung.out + hung.err
    text = lines[0]
    assert "no step progress for 5 s (hardware.hang_timeout_s)" in text
    assert "Rank 1 is in training_step at step 5 (" in text and "tests_helpers.py:" in text
    assert "not in a collective; rank 0 waits in backward" in text and "torch/autograd/" in text
    assert "Traceback" not in hung.out + hung.err
    error = hung.summary()["error"]
    assert error["type"] == "hang" and error["rank"] == 1 and error["step"] == 5
    assert error["message"] == text and hung.summary()["status"] == "failed"


def test_every_rank_dumped_its_stacks(hung):
    logs = hung.run_dir / "logs"
    for rank, frame in ((0, "_engine_run_backward"), (1, "training_step")):
        dump = (logs / f"hang-rank-{rank}.txt").read_text()
        assert dump.startswith(f"rank {rank} (host ") and "at step 5" in dump
        assert "Current thread" in dump and "loom-hang-watchdog" not in dump.split("\n")[0]
        assert frame in dump, dump  # faulthandler's frames: the main thread's included


def test_nothing_else_is_lost(hung):
    """The last checkpoint (step 4) is whole and loads the way a resume loads it."""
    last = hung.run_dir / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "step-0000004.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4 and ckpt["state_dict"]


@pytest.mark.parametrize("value", ["300", "400", "-1"])
def test_a_hang_timeout_at_or_above_the_collective_timeout_is_refused(tmp_path, value):
    """The value as validation typed it (a float: `300.0`, never the raw `300`), the rule, and
    the key it must stay below, in one rendering."""
    err = refused(tmp_path, "hardware=cpu", "hardware.timeout_train_s=300", f"hardware.hang_timeout_s={value}")
    assert f"hardware.hang_timeout_s={float(value)}: must be below hardware.timeout_train_s=300 (the collective " \
        "timeout, which would end the run first, with no report), or 0 for no watchdog" in err, err


def test_the_paragraph_groups_ranks_and_names_the_odd_one_first():
    from loom.rundir.failures import failure_paragraph, root_failure
    from loom.rundir.hangs import merge_hangs

    waiting = {"type": "hang", "label": "waits in all_reduce", "where": "torch/distributed/c10d.py:10", "step": 120,
               "timeout_s": 240, "log": "/r/logs/hang-rank-0.txt"}
    records = [{**waiting, "rank": r, "time": 5.0 + r} for r in (0, 1, 2, 4, 5, 6, 7)]
    records.append({**waiting, "rank": 3, "time": 9.0, "label": "is in forward", "where": "model.py:88"})
    records.append({"type": "RuntimeError", "message": "Connection closed by peer", "rank": 0, "time": 20.0})
    merged = merge_hangs(records)
    assert len(merged) == 2
    root = root_failure(merged)
    assert root["type"] == "hang" and root["rank"] == 3
    assert failure_paragraph(root) == (
        "Training hung: no step progress for 240 s (hardware.hang_timeout_s). Rank 3 is in forward at step 120 "
        "(model.py:88), not in a collective; ranks 0-2, 4-7 wait in all_reduce at step 120 "
        "(torch/distributed/c10d.py:10). Every thread's stack of each rank: /r/logs/hang-rank-N.txt.")


def test_a_long_checkpoint_write_is_not_a_hang(tmp_path):
    """While a checkpoint is being written (Checkpointing.writing) the watchdog keeps still; once
    the write is over, the same silence is a hang (in-process: it only dumps, never exits).

    No fixed sleep decides it: `busy` counts the watchdog's looks. Each look comes a second
    after the last beat, twice the 0.5 s timeout, so each is a look at which a watchdog ignoring
    the write would have dumped (and stopped: in-process it returns after its one report)."""
    import time

    from loom.worker.failure import Progress
    from loom.worker.hang import HangWatchdog

    (tmp_path / "logs").mkdir()
    dump = tmp_path / "logs" / "hang-rank-0.txt"
    writing, looks = [True], [0]

    def busy() -> bool:
        looks[0] += 1
        return writing[0]

    dog = HangWatchdog(tmp_path, 0, 0.5, Progress(), busy=busy)
    assert dog.thread is None  # not armed before the first step
    dog.on_train_batch_end(None, None, None, None, 0)  # armed after the first step
    deadline = time.monotonic() + 120  # a guard against a stuck test only
    while looks[0] < 3 and dog.thread.is_alive():  # three looks while writing, or it dumped and returned
        assert time.monotonic() < deadline, looks
        time.sleep(0.05)
    assert dog.thread.is_alive() and not dump.exists()
    writing[0] = False
    dog.thread.join(timeout=120)  # in-process, the watchdog returns after its report
    assert not dog.thread.is_alive()
    text = dump.read_text()
    assert text.startswith("rank 0 (host ") and "at step 1 (hardware.hang_timeout_s=0.5)" in text, text[:300]
