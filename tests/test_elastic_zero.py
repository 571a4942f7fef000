"""ZeRO runs change their world size on resume (issue 18), for real: `loom train` on CPU processes
(gloo, fp32, tiny GPT).

Per strategy (zero2, zero3_offload: ZeRO-3 with the optimizer state in host memory, the engine
path of zero3 plus the offloaded Adam state), one chain of three launches, side by side (zero1
changes its world in test_elastic's chain, preempted by SIGTERM):
1. an uninterrupted 2-rank run (the reference), checkpointing every 2 steps;
2. a copy of it cut back to its step-2 checkpoint, resumed with `hardware.devices=1`: rank 0
   converts the 2-rank checkpoint to DeepSpeed's universal checkpoint beside it and the 1-rank
   engine loads its (whole) partition of every parameter and Adam state;
3. a copy of (2) cut back to its step-4 checkpoint (written by 1 rank), resumed with
   `hardware.devices=2`: the world grows back.

Why the losses after each change must match the reference within 1e-4: the global batch is
kept (accumulation re-derived), the data order is global, and the loaded fp32 masters and Adam
m and v are the saved ones, so each step sees the same samples and the same state; what differs
is float32 summation order (a mean of two micro-batch means vs. an all-reduce of two rank means,
one flat partition vs. two). A wrong weight or Adam state, or a shifted sample, moves the loss by
more than 1e-3 at this size.
"""

from __future__ import annotations

import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import FAST, LoomResult, launching_fixture, run_loom

pytestmark = pytest.mark.slow

STEPS = 6
TOL = 1e-4
CHAINS = ("zero2", "zero3_offload")
ARGS = [*[a for a in FAST if not a.startswith("checkpoint.")], f"trainer.max_steps={STEPS}",
        "dataset.batch_size=4", "dataset.seq_len=64", "checkpoint.every_n_steps=2", "checkpoint.keep_last=3"]


def _cut_back(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of `run_dir` at `dest` left the way a run stopped after its step-`step` checkpoint
    is: later checkpoints, final weights and summary removed."""
    from loom.rundir.checkpoints import complete_checkpoints, step_of

    shutil.copytree(run_dir, dest, symlinks=True)
    shutil.rmtree(dest / "final", ignore_errors=True)
    (dest / "summary.json").unlink(missing_ok=True)
    for path in complete_checkpoints(dest):
        if step_of(path) > step:
            shutil.rmtree(path)
    last = dest / "checkpoints" / "last.ckpt"
    last.unlink(missing_ok=True)
    last.symlink_to(f"step-{step:07d}.ckpt")
    return dest


def _digest(ckpt: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        h.update(f.relative_to(ckpt).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def _chain(strategy: str, root: Path) -> dict:
    """Reference, shrink (2 -> 1 at step 2), grow (1 -> 2 at step 4); see the module docstring."""
    rid = f"e-{strategy}"
    for sub in ("ref", "shrink", "grow"):
        (root / sub).mkdir(parents=True)
    out: dict = {"ref": run_loom("train", f"strategy={strategy}", *ARGS, f"run.id={rid}", root=root / "ref")}
    ref_dir = out["ref"].run_dir
    if out["ref"].rc != 0:
        return out
    shrink = _cut_back(ref_dir, root / "shrink" / ref_dir.relative_to(root / "ref"), 2)
    out["ref_step2"] = _digest(ref_dir / "checkpoints" / "step-0000002.ckpt")
    out["shrink"] = run_loom("train", f"strategy={strategy}", *ARGS, f"run.id={rid}", "hardware.devices=1",
                             root=root / "shrink")
    out["shrink_step2"] = _digest(shrink / "checkpoints" / "step-0000002.ckpt")
    if out["shrink"].rc != 0:
        return out
    _cut_back(shrink, root / "grow" / ref_dir.relative_to(root / "ref"), 4)
    out["grow"] = run_loom("train", f"strategy={strategy}", *ARGS, f"run.id={rid}", "hardware.devices=2",
                           root=root / "grow")
    return out


@launching_fixture(scope="module")
def chains(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("elastic_zero")
    with ThreadPoolExecutor(2) as pool:
        futures = {s: pool.submit(_chain, s, root / s) for s in CHAINS}
        out = {s: f.result() for s, f in futures.items()}
    return out


def _ok(r: LoomResult) -> dict:
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    s = r.summary()
    assert s["status"] == "completed" and s["global_step"] == STEPS, s
    return s


@pytest.mark.parametrize("strategy", CHAINS)
def test_zero_shrinks_then_grows_on_the_same_curve(chains, strategy):
    c = chains[strategy]
    ref = _ok(c["ref"])
    assert ref["world_size"] == 2
    want = c["ref"].losses()
    assert sorted(want) == list(range(1, STEPS + 1))

    shrink = _ok(c["shrink"])
    assert shrink["world_size"] == 1 and shrink["resumed_from_step"] == 2
    log = (c["shrink"].run_dir / "logs" / "rank-0.log").read_text()
    assert "written by 2 data-parallel ranks, this run has 1" in log, log[-2000:]
    assert (c["shrink"].run_dir / "checkpoints" / "step-0000002.ckpt.universal" / "latest_universal").is_file()
    assert c["shrink_step2"] == c["ref_step2"], "the original checkpoint was modified"
    got = c["shrink"].losses()
    diffs = {step: abs(got[step] - want[step]) for step in range(3, STEPS + 1)}
    print(strategy, "2 -> 1 at step 2, |loss - reference| by step:", diffs)
    assert max(diffs.values()) < TOL, (got, want)

    grow = _ok(c["grow"])
    assert grow["world_size"] == 2 and grow["resumed_from_step"] == 4
    log = (c["grow"].run_dir / "logs" / "rank-0.log").read_text()
    assert "written by 1 data-parallel ranks, this run has 2" in log, log[-2000:]
    got = c["grow"].losses()
    diffs = {step: abs(got[step] - want[step]) for step in range(5, STEPS + 1)}
    print(strategy, "1 -> 2 at step 4, |loss - reference| by step:", diffs)
    assert max(diffs.values()) < TOL, (got, want)
    history = [(e["start_step"], e["world_size"], e["reason"]) for e in grow["world_history"]]
    assert history == [(0, 2, "start"), (2, 1, "world change"), (4, 2, "world change")], history


def test_pruning_a_checkpoint_drops_its_universal_form(chains):
    """The universal sibling is derived from its checkpoint: it goes with it (keep_last)."""
    from loom.rundir.checkpoints import complete_checkpoints, remove

    ckpts = chains["zero2"]["shrink"].run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts.parent)][-1] == "step-0000002.ckpt"
    remove(ckpts / "step-0000002.ckpt")
    assert not (ckpts / "step-0000002.ckpt").exists()
    assert not (ckpts / "step-0000002.ckpt.universal").exists()
    assert (ckpts / "step-0000004.ckpt").is_dir()


def test_recorded_world_and_a_tampered_universal_form_is_rebuilt(chains):
    """The world size is read from the checkpoint's own record; a universal form that fails Loom's
    pickle allow-list is never handed to DeepSpeed (which unpickles it): it is converted again."""
    import pickle

    from loom.strategies.deepspeed import use_cpu_accelerator
    from loom.strategies.deepspeed_universal import convert, saved_dp_world, universal_dir

    use_cpu_accelerator()
    ref, grow = chains["zero3_offload"]["ref"].run_dir, chains["zero3_offload"]["grow"].run_dir
    assert saved_dp_world(ref / "checkpoints" / "step-0000004.ckpt") == 2
    ckpt = grow / "checkpoints" / "step-0000004.ckpt"  # written by the 1-rank attempt
    assert saved_dp_world(ckpt) == 1
    planted = universal_dir(ckpt) / "checkpoint" / "zero" / "evil.pt"
    planted.write_bytes(pickle.dumps(print))  # names builtins.print: outside the allow-list
    assert convert(ckpt) == universal_dir(ckpt)
    assert not planted.exists() and (universal_dir(ckpt) / "latest_universal").is_file()
