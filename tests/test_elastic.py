"""Elastic world size: a run resumes at another world, keeps its global batch, its global data
order and its loss curve; worlds the layout cannot use are refused naming those that can.

One 2-rank uninterrupted reference (ddp) serves every strategy: ddp, fsdp and fsdp_tp train the
same math in fp32 (same init, same global batch of the same samples, the same AdamW), so their
curves agree to float32 summation order (seen: 2.4e-7 at most), far inside the 1e-4 checked.
The learning rate is flat after a 2-step warmup (optim.min_lr_ratio=1.0), so a continuation
with a raised trainer.max_steps (rundir/extension.py) is the same schedule as the reference's:
each chain is preempted (SIGTERM) at 2 ranks, resumes at 1 to PHASE_STEPS, then grows back to 2
ranks with max_steps raised to STEPS.

The two chains check different things on the same curve: fsdp (DCP resharding) is preempted by
a SIGTERM to one of its ranks, not the launcher, and validates every VAL_EVERY steps at every
world; zero1 (DeepSpeed's universal checkpoint) is preempted by a SIGTERM to its launcher.
ddp's own elastic resume is the reference's strategy (it shares the sampler and accumulation
path checked here) and the two-node tests' (test_elastic_nodes).

Every run here trains a two-source mixture (`dataset=tokens`, weights 0.7 / 0.3): the samples,
the tokens drawn from each source and the per-source validation losses of every resumed chain
equal the uninterrupted reference's. The fsdp chain reads source lib_a from object storage (a
local S3 API, moto's server, started here; one loader worker per rank through a small node cache)
and lib_b from disk, as the reference reads both from disk: the same global order at every world
is then also the remote store's (issue 54). (Packed by concatenation: the pipelined run cannot take
document masks; `dataset.packing=documents` is launched in tests/test_data.py under fsdp_tp.)
"""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import LoomResult, launching_fixture, run_loom, start_loom, wait_for, worker_pids

from loom.data.sampler import ResumableDistributedSampler

PHASE_STEPS, STEPS = 16, 20
TOL = 1e-4
TINYCODE = ["dataset.max_bytes=2000000"]  # the runs that do not train the mixture
ARGS = ["tracking=csv", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2",
        "dataset.batch_size=2", "dataset.seq_len=32", "optim.warmup_steps=2", "optim.min_lr_ratio=1.0",
        "hardware.dataloader_workers=0"]
CHAIN_STRATEGIES = ["fsdp", "zero1"]
VAL_EVERY = 4
# What each chain adds to the shared ARGS, and whom its SIGTERM goes to.
CHAIN = {"fsdp": ([f"trainer.val_every_n_steps={VAL_EVERY}"], "rank"), "zero1": ([], "launcher")}


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


def _train(root: Path, rid: str, *extra: str, ids: Path | None = None, env: dict | None = None) -> LoomResult:
    env = {**(env or {}), **({"LOOM_RECORD_SAMPLE_IDS": str(ids)} if ids else {})}
    return run_loom("train", *ARGS, *_data(extra), f"run.id={rid}", *extra, root=root, env=env or None)


def _data(extra: tuple[str, ...]) -> list[str]:
    return [] if "dataset=tokens" in extra else TINYCODE


def _preempted(root: Path, rid: str, *extra: str, ids: Path, at: str = "launcher", env: dict | None = None) -> LoomResult:
    """A 2-rank run SIGTERMed once its step-2 checkpoint exists (exit 143, preempted): at its
    launcher, or at its last rank (`at="rank"`: the ranks agree to stop at the next boundary)."""
    proc = start_loom("train", *ARGS, *_data(extra), f"run.id={rid}", *extra, root=root,
                      env={**(env or {}), "LOOM_RECORD_SAMPLE_IDS": str(ids)})
    run_dir = root / "gpt" / rid
    wait_for(run_dir / "checkpoints" / "step-0000002.ckpt", proc)
    if at == "rank":
        ranks = worker_pids(run_dir)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    return LoomResult(proc.returncode, out, "", run_dir)


def _mixture(root: Path) -> list[str]:
    """Two byte-level stores (`loom data prepare`'s machinery, in this process) of standard
    library files, mixed 0.7 / 0.3."""
    from loom.data.options.tinycode import corpus_files
    from loom.data.prepare import file_doc_units, prepare

    files = corpus_files(600_000)
    for name, part in (("lib_a", files[0::2]), ("lib_b", files[1::2][:40])):
        prepare(file_doc_units(part), root / name, None, workers=1, progress="none")
    return ["dataset=tokens", f"dataset.mix=[{{path: {root / 'lib_a'}, weight: 0.7}}, "
            f"{{path: {root / 'lib_b'}, weight: 0.3}}]", "dataset.val_fraction=0.05"]


def _remote_mixture(root: Path, s3) -> list[str]:
    """The same mixture with lib_a uploaded to the local S3 server and read through a 16 MB node
    cache of 1 MB chunks, by one loader worker per rank (lib_b stays on disk)."""
    url = s3.bucket("elastic") + "/tok/lib_a"
    s3.upload_dir(root / "lib_a", url)
    return ["dataset=tokens", f"dataset.mix=[{{path: '{url}', weight: 0.7, name: lib_a}}, "
            f"{{path: {root / 'lib_b'}, weight: 0.3}}]", "dataset.val_fraction=0.05",
            f"dataset.cache.dir={root / 'node-cache'}", "dataset.cache.max_gb=0.015625", "dataset.cache.chunk_mb=1",
            "hardware.dataloader_workers=1"]


@launching_fixture(scope="module")
def elastic(tmp_path_factory) -> dict:
    """The reference, then per strategy: 2 ranks preempted -> 1 rank -> 2 ranks (raised max_steps);
    the fsdp chain reads lib_a from a local S3 server."""
    from s3_helpers import LocalS3

    root = tmp_path_factory.mktemp("elastic")
    mix = _mixture(root)
    s3 = LocalS3()
    out: dict = {"root": root, "mix": mix}
    try:
        remote = {"fsdp": (_remote_mixture(root, s3), s3.env())}
        out["ref"] = _train(root, "ref", *mix, "strategy=ddp", "hardware.devices=2", f"trainer.max_steps={STEPS}",
                            ids=root / "ids-ref")
        for s in CHAIN_STRATEGIES:
            ids, (more, at) = root / f"ids-{s}", CHAIN[s]
            data, env = remote.get(s, (mix, None))
            more = [*data, *more]
            first = _preempted(root, s, f"strategy={s}", *more, "hardware.devices=2",
                               f"trainer.max_steps={PHASE_STEPS}", ids=ids, at=at, env=env)
            out[f"{s}-preempted"] = first.summary() if first.rc == 143 else {}  # later phases rewrite it
            shrunk = _train(root, s, f"strategy={s}", *more, "hardware.devices=1", f"trainer.max_steps={PHASE_STEPS}",
                            ids=ids, env=env)
            grown = _train(root, s, f"strategy={s}", *more, "hardware.devices=2", f"trainer.max_steps={STEPS}",
                           ids=ids, env=env)
            out[s] = (first, shrunk, grown)
        out["s3_ranged"] = s3.faults.ranged
    finally:
        s3.stop()
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
    assert "; global batch 4 (2 x 2 accumulated x 1 ranks)" in shrunk.out  # what it trains, not 2 x 1
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
    # the mixture's draw per source is the reference's, and within one sample of its weights
    drawn = s["data"]["sources"]
    assert drawn == ref.summary()["data"]["sources"], (drawn, ref.summary().get("data"))
    assert drawn["lib_a"]["samples"] + drawn["lib_b"]["samples"] == STEPS * 4
    assert abs(drawn["lib_b"]["samples"] - 0.3 * STEPS * 4) <= 1 and drawn["lib_b"]["tokens"] > 0
    worlds = {int(r["step"]): float(r["sys/world_size"]) for r in grown.metrics() if r.get("sys/world_size")}
    assert worlds[stopped + 1] == 1.0 and worlds[PHASE_STEPS + 1] == 2.0 and worlds[1] == 2.0
    plan = json.loads((grown.run_dir / "plan.json").read_text())
    assert plan["world_changes"] == [{"at_step": stopped, "from_world": 2, "to_world": 1},
                                     {"at_step": PHASE_STEPS, "from_world": 1, "to_world": 2}]
    assert _world_change_lines(grown.run_dir / "plots" / "throughput.png") == 2
    if strategy == "fsdp":
        _assert_periodic_validation(grown, stopped)
        _assert_read_from_object_storage(elastic, first, grown)


def _assert_read_from_object_storage(elastic: dict, first: LoomResult, grown: LoomResult) -> None:
    """The fsdp chain's lib_a came from S3: the launch line says where and how big the cache may
    grow, summary.json `storage` counts the attempt's fetches and cache hits, and the node cache
    stayed within its 16 MB."""
    assert "lib_a loom " in first.out and "at s3://elastic/tok/lib_a" in first.out, first.out
    assert "object storage through the node's cache" in first.out and "at most 0.015625 GB" in first.out
    st = grown.summary()["storage"]  # the last attempt's, every rank
    assert st["scope"] == "this attempt, all ranks" and st["retries"] == 0 and st["uncached"] == 0, st
    # one GET per chunk per node over the whole chain (the lib_a store is one 1 MB chunk): the cache outlives
    # attempts, and the last one found it there
    assert elastic["s3_ranged"] == 1 and st["requests"] == st["misses"] == 0 and st["hits"] > 0, st
    assert "perf/storage_wait_ms" in grown.metrics()[-1]
    cache = elastic["root"] / "node-cache"
    assert 0 < sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) <= (1 << 24)


def _assert_periodic_validation(run: LoomResult, stopped: int) -> None:
    """trainer.val_every_n_steps at every world: val/loss every VAL_EVERY steps, whichever
    attempt trained them, and the last one in summary.json `validation`. The preemption saved
    and stopped without validating (Lightning would validate a run that stops early): none at
    the step it stopped at, periodic or not (the next attempt starts after it)."""
    val = {int(r["step"]): float(r["val/loss"]) for r in run.metrics() if r.get("val/loss")}
    periodic = set(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
    assert periodic - {stopped} <= set(val) <= periodic - {stopped}, (val, stopped)
    assert any(stopped < k <= PHASE_STEPS for k in val)  # one of them at world 1
    v = run.summary()["validation"]
    assert v["step"] == STEPS and abs(v["loss"] - val[STEPS]) < 1e-6, v
    per_source = v["per_source"]  # val/loss/<source>: each source's held-out windows
    assert set(per_source) == {"lib_a", "lib_b"} and min(per_source.values()) < v["loss"] < max(per_source.values())


def _world_change_lines(png: Path) -> int:
    """The dashed vertical lines `loom report` draws at each world change (plots.py: tab:red,
    spanning both panels): image columns in which a red run covers over a quarter of the
    height (the rotated red label beside each line is far shorter); adjacent columns are one
    line (antialiasing)."""
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png)[..., :3]
    red = (np.abs(img - np.array([0xD6, 0x27, 0x28]) / 255).max(axis=-1) < 0.12)
    cols = np.flatnonzero(red.sum(axis=0) > 0.25 * img.shape[0])
    return int(len(cols) and 1 + np.count_nonzero(np.diff(cols) > 1))


@pytest.mark.slow
def test_world_that_cannot_keep_the_global_batch_is_refused_naming_the_sizes(elastic):
    run_dir = elastic["zero1"][2].run_dir
    before = (run_dir / "config.yaml").read_text()
    r = _train(elastic["root"], "zero1", *elastic["mix"], "strategy=zero1", "hardware.devices=3", f"trainer.max_steps={STEPS + 2}")
    assert r.rc == 2, r.out + r.err
    assert "world of 3 rank(s)" in r.err and "trainer.global_batch_size=4: 1, 2" in r.err, r.err
    assert "Traceback" not in r.err
    other = _train(elastic["root"], "zero1", *elastic["mix"], "strategy=fsdp", "hardware.devices=2", f"trainer.max_steps={STEPS + 2}")
    assert other.rc == 2 and "strategy.name: 'zero1' -> 'fsdp'" in other.err, other.err
    assert (run_dir / "config.yaml").read_text() == before  # refusals leave the run as it was


@pytest.mark.launch
@pytest.mark.slow
def test_fsdp_tp_preempted_at_four_ranks_resumes_at_two_and_refuses_three(elastic):
    """SIGTERM under fsdp_tp (2 x 2): the 4 ranks stop at a checkpoint; 3 ranks are refused (tp
    must divide the world), 2 ranks (1 x 2) reshard it through DCP and follow the curve."""
    root, ids = elastic["root"], elastic["root"] / "ids-tp"
    tp = [*elastic["mix"], "strategy=fsdp_tp", "strategy.tensor_parallel=2"]
    first = _preempted(root, "tp", *tp, "hardware.devices=4", "trainer.global_batch_size=4", "trainer.max_steps=8",
                       ids=ids)
    assert first.rc == 143, first.out
    s = first.summary()
    stopped = s["global_step"]
    assert s["status"] == "preempted" and 2 <= stopped < 8 and s["world_size"] == 4, s
    assert (first.run_dir / "checkpoints" / f"step-{stopped:07d}.ckpt").exists()
    three = _train(root, "tp", *tp, "hardware.devices=3", "trainer.max_steps=8")
    assert three.rc == 2 and "hardware.devices=2, 4, 6" in three.err, three.err
    two = _train(root, "tp", *tp, "hardware.devices=2", "trainer.max_steps=8", ids=ids)
    assert two.rc == 0, two.out + two.err
    assert f"World change: 4 -> 2 rank(s) from step {stopped}" in two.out
    s = two.summary()
    assert s["world_size"] == 2 and s["parallel"]["tp"] == 2 and s["global_step"] == 8
    ref = elastic["ref"].losses()
    assert max(abs(two.losses()[k] - ref[k]) for k in range(1, 9)) < TOL
    assert _ids(ids, dedupe_tp=2) == {k: v for k, v in _ids(root / "ids-ref").items() if k <= 8}


@pytest.mark.launch
@pytest.mark.slow
def test_pipelined_nd_preempted_resumes_at_its_world_and_refuses_another(elastic):
    """SIGTERM under strategy=nd with 2 pipeline stages (pp 2 x dp 1): a checkpointed stop. A
    pipelined run does not accumulate (its microbatches are the schedule's), so the global batch
    fixes its data-parallel degree: world 4 (dp 2) is refused naming the world that keeps it, and
    the same world resumes on the reference's curve."""
    root = elastic["root"]
    nd = [*elastic["mix"], "strategy=nd", "strategy.pp=2", "dataset.batch_size=4", "trainer.global_batch_size=4",
          "trainer.max_steps=8"]
    first = _preempted(root, "nd", *nd, "hardware.devices=2", ids=root / "ids-nd")
    assert first.rc == 143, first.out
    s = first.summary()
    stopped = s["global_step"]
    assert s["status"] == "preempted" and 2 <= stopped < 8 and s["parallel"]["pp"] == 2, s
    four = _train(root, "nd", *nd, "hardware.devices=4")
    assert four.rc == 2 and "World sizes that keep strategy=nd and trainer.global_batch_size=4: 2 " in four.err, four.err
    again = _train(root, "nd", *nd, "hardware.devices=2")
    assert again.rc == 0, again.out + again.err
    s = again.summary()
    assert s["status"] == "completed" and s["global_step"] == 8 and s["resumed_from_step"] == stopped
    ref = elastic["ref"].losses()
    assert max(abs(again.losses()[k] - ref[k]) for k in range(1, 9)) < TOL, (again.losses(), ref)
