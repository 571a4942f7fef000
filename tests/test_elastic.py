"""Elastic world size: a run resumes at another world, keeps its global batch, its global data
order and its loss curve; worlds the layout cannot use are refused naming those that can.

One 2-rank uninterrupted reference (ddp) serves every strategy: ddp, fsdp and fsdp_tp train the
same math in fp32 (same init, same global batch of the same samples, the same AdamW), so their
curves agree to float32 summation order (seen: 2.4e-7 at most), far inside the 1e-4 checked.
The learning rate is flat after a 2-step warmup (optim.min_lr_ratio=1.0), so a continuation
with a raised trainer.max_steps (rundir/extension.py) is the same schedule as the reference's:
each chain is preempted (SIGTERM) at 2 ranks, resumes at 1 to PHASE_STEPS, then grows back to 2
ranks with max_steps raised to STEPS.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import LOOM, LoomResult, launching_fixture, run_loom, wait_for

from loom.data.sampler import ResumableDistributedSampler

PHASE_STEPS, STEPS = 16, 20
TOL = 1e-4
ARGS = ["dataset.max_bytes=2000000", "tracking=csv", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2",
        "dataset.batch_size=2", "dataset.seq_len=32", "optim.warmup_steps=2", "optim.min_lr_ratio=1.0",
        "hardware.dataloader_workers=0"]
# zero2 / zero3 join the chains once the ZeRO universal-checkpoint conversion lands (issue 18,
# strategies/deepspeed_universal.py): add them here.
CHAIN_STRATEGIES = ["ddp", "fsdp"]


# ----------------------------------------------------------------------------- in-process


def _sampler(dp: int, rank: int, micro: int = 2, gbs: int = 8) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(range(101), num_replicas=dp, rank=rank, micro_batch=micro, global_batch=gbs,
                                       seed=3)


def _steps(dp: int, micro: int = 2, gbs: int = 8, skip: int = 0) -> list[list[int]]:
    """Each optimizer step's samples (sorted) as the `dp` ranks consume them, from `skip` on."""
    per_rank = []
    for r in range(dp):
        s = _sampler(dp, r, micro, gbs)
        s.set_epoch(1)
        if skip:
            s.resume_at(1, skip)
        per_rank.append(list(s))
    per_step = gbs // dp
    n = len(per_rank[0]) // per_step
    return [sorted(i for ids in per_rank for i in ids[k * per_step:(k + 1) * per_step]) for k in range(n)]


def test_global_order_is_the_same_steps_at_any_dp_and_resumes_across_dp():
    one, two, four = _steps(1), _steps(2), _steps(4)
    assert one == two == four and len(one) == 101 // 8
    # 3 steps consumed at dp=2, resumed at dp=4 (and at dp=1): exactly the remaining steps
    assert _steps(4, skip=24) == _steps(1, skip=24) == one[3:]
    flat = [i for step in one for i in step]
    assert len(flat) == len(set(flat))  # no sample twice in an epoch
    with pytest.raises(ValueError):
        _sampler(4, 0).resume_at(1, 4)  # not a step boundary of 4 ranks x micro 2


# ----------------------------------------------------------------------------- real runs


def _ids(d: Path, dedupe_tp: int = 1) -> dict[int, list[int]]:
    """Samples trained per optimizer step (sorted), from LOOM_RECORD_SAMPLE_IDS files. With
    tensor parallelism the `dedupe_tp` peers of a dp rank read the same batch: keep one."""
    out: dict[int, list[int]] = defaultdict(list)
    for f in sorted(d.glob("rank-*.txt")):
        if int(f.stem.split("-")[1]) % dedupe_tp:
            continue
        for line in f.read_text().splitlines():
            step, _, *ids = map(int, line.split())
            out[step] += ids
    return {k: sorted(v) for k, v in out.items()}


def _train(root: Path, rid: str, *extra: str, ids: Path | None = None) -> LoomResult:
    env = {"LOOM_RECORD_SAMPLE_IDS": str(ids)} if ids else None
    return run_loom("train", *ARGS, f"run.id={rid}", *extra, root=root, env=env)


def _preempted(root: Path, rid: str, *extra: str, ids: Path) -> LoomResult:
    """A 2-rank run SIGTERMed once its step-2 checkpoint exists (exit 143, preempted)."""
    import os
    import subprocess

    env = {**os.environ, "WANDB_MODE": "offline", "LOOM_RECORD_SAMPLE_IDS": str(ids)}
    proc = subprocess.Popen([*LOOM, "train", *ARGS, f"run.id={rid}", *extra, f"run.root={root}"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = root / "gpt" / rid
    wait_for(run_dir / "checkpoints" / "step-0000002.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return LoomResult(proc.returncode, out, "", run_dir)


@launching_fixture(scope="module")
def elastic(tmp_path_factory) -> dict:
    """The reference, then per strategy: 2 ranks preempted -> 1 rank -> 2 ranks (raised max_steps)."""
    root = tmp_path_factory.mktemp("elastic")
    out: dict = {"root": root}
    out["ref"] = _train(root, "ref", "strategy=ddp", "hardware.devices=2", f"trainer.max_steps={STEPS}",
                        ids=root / "ids-ref")
    for s in CHAIN_STRATEGIES:
        ids = root / f"ids-{s}"
        first = _preempted(root, s, f"strategy={s}", "hardware.devices=2", f"trainer.max_steps={PHASE_STEPS}", ids=ids)
        out[f"{s}-preempted"] = first.summary() if first.rc == 143 else {}  # later phases rewrite it
        shrunk = _train(root, s, f"strategy={s}", "hardware.devices=1", f"trainer.max_steps={PHASE_STEPS}", ids=ids)
        grown = _train(root, s, f"strategy={s}", "hardware.devices=2", f"trainer.max_steps={STEPS}", ids=ids)
        out[s] = (first, shrunk, grown)
    return out


def _assert_same_curve(ref: LoomResult, run: LoomResult, after: int) -> float:
    la, lb = ref.losses(), run.losses()
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    worst = max(abs(la[k] - lb[k]) for k in la if k > after)
    assert worst < TOL, (worst, la, lb)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CHAIN_STRATEGIES)
def test_preempted_run_shrinks_to_one_rank_then_grows_back(elastic, strategy):
    ref = elastic["ref"]
    assert ref.rc == 0, ref.out + ref.err
    first, shrunk, grown = elastic[strategy]
    assert first.rc == 143, first.out
    preempted = elastic[f"{strategy}-preempted"]
    stopped = preempted["global_step"]
    assert preempted["status"] == "preempted" and 2 <= stopped < PHASE_STEPS
    assert shrunk.rc == 0, shrunk.out + shrunk.err
    assert f"World change: 2 -> 1 rank(s) from step {stopped}" in shrunk.out
    assert "trainer.accumulate_grad_batches 1 -> 2 keeps trainer.global_batch_size=4" in shrunk.out
    assert grown.rc == 0, grown.out + grown.err
    s = grown.summary()
    assert s["status"] == "completed" and s["global_step"] == STEPS and s["world_size"] == 2
    assert s["samples"] == ref.summary()["samples"] == STEPS * 4
    assert [(h["world_size"], h["reason"]) for h in s["world_history"]] == [
        (2, "start"), (1, "world change"), (2, "world change")]
    assert [h["start_step"] for h in s["world_history"]] == [0, stopped, PHASE_STEPS]
    _assert_same_curve(ref, grown, after=stopped)
    # every step trained exactly the reference's samples: none skipped, none repeated
    root = elastic["root"]
    assert _ids(root / f"ids-{strategy}") == _ids(root / "ids-ref")
    worlds = {int(r["step"]): float(r["sys/world_size"]) for r in grown.metrics() if r.get("sys/world_size")}
    assert worlds[stopped + 1] == 1.0 and worlds[PHASE_STEPS + 1] == 2.0 and worlds[1] == 2.0
    plan = json.loads((grown.run_dir / "plan.json").read_text())
    assert plan["world_changes"] == [{"at_step": stopped, "from_world": 2, "to_world": 1},
                                     {"at_step": PHASE_STEPS, "from_world": 1, "to_world": 2}]
    assert (grown.run_dir / "plots" / "throughput.png").is_file()


@pytest.mark.slow
def test_world_that_cannot_keep_the_global_batch_is_refused_naming_the_sizes(elastic):
    run_dir = elastic["ddp"][2].run_dir
    before = (run_dir / "config.yaml").read_text()
    r = _train(elastic["root"], "ddp", "strategy=ddp", "hardware.devices=3", f"trainer.max_steps={STEPS + 2}")
    assert r.rc == 2, r.out + r.err
    assert "world of 3 rank(s)" in r.err and "trainer.global_batch_size=4: 1, 2" in r.err, r.err
    assert "Traceback" not in r.err
    other = _train(elastic["root"], "ddp", "strategy=fsdp", "hardware.devices=2", f"trainer.max_steps={STEPS + 2}")
    assert other.rc == 2 and "strategy.name: 'ddp' -> 'fsdp'" in other.err, other.err
    assert (run_dir / "config.yaml").read_text() == before  # refusals leave the run as it was


@pytest.mark.launch
@pytest.mark.slow
def test_fsdp_tp_resumes_from_four_to_two_ranks_and_refuses_three(elastic):
    root, ids = elastic["root"], elastic["root"] / "ids-tp"
    tp = ["strategy=fsdp_tp", "strategy.tensor_parallel=2"]
    first = _train(root, "tp", *tp, "hardware.devices=4", "trainer.global_batch_size=4", "trainer.max_steps=4", ids=ids)
    assert first.rc == 0, first.out + first.err
    three = _train(root, "tp", *tp, "hardware.devices=3", "trainer.max_steps=8")
    assert three.rc == 2 and "hardware.devices=2, 4, 6" in three.err, three.err
    two = _train(root, "tp", *tp, "hardware.devices=2", "trainer.max_steps=8", ids=ids)
    assert two.rc == 0, two.out + two.err
    assert "World change: 4 -> 2 rank(s) from step 4" in two.out
    s = two.summary()
    assert s["world_size"] == 2 and s["parallel"]["tp"] == 2 and s["global_step"] == 8
    ref = elastic["ref"].losses()
    assert max(abs(two.losses()[k] - ref[k]) for k in range(1, 9)) < TOL
    assert _ids(ids, dedupe_tp=2) == {k: v for k, v in _ids(root / "ids-ref").items() if k <= 8}
