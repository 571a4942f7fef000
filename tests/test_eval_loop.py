"""Benchmark evaluation in the training loop (loom.worker.evaluation): which steps are scored, the
gather of a sharded model to rank 0 (FSDP2 on 2 spawned gloo ranks), a failing evaluation reported
while training goes on (in-process), and what the DDP run of tests/test_tracking.py, which evaluates
`tinycode_mc` at steps 8 and 12, records: eval/step-N.json, the trackers' metrics, summary.json's
`eval` and its time split, and step times that hold no evaluation second."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import STEPS as PARITY_STEPS
from conftest import launching_fixture, strategy_args
from test_tracking import DDP_ARGS, EVAL_EVERY, SENTINELS, STEPS

from loom.pipeline import resolve
from loom.worker.evaluation import Evaluation, full_copy, gather_state, held_whole

TINY = ["hardware=cpu", "model=gpt_tiny", "model.n_layer=2"]  # dataset.seq_len 128: the task's contexts fit
EVAL = ["eval.tasks=[tinycode_mc]", "eval.limit=4", "eval.batch_size=4"]


def _cfg(*extra: str):
    return resolve([*TINY, *EVAL, *extra])


class _Strategy:
    """The strategy face the route uses: Loom's own methods (loom.strategies.base), on the CPU."""

    from loom.strategies.base import LoomStrategy as _Base

    model_state_entries = _Base.model_state_entries
    full_shape = _Base.full_shape
    gather_full_tensor = _Base.gather_full_tensor
    root_device = torch.device("cpu")
    precision_plugin = SimpleNamespace(forward_context=contextlib.nullcontext)


def _trainer(rank: int = 0, world: int = 1, step: int = 4, max_steps: int = 8, loggers=()):
    return SimpleNamespace(strategy=_Strategy(), is_global_zero=rank == 0, global_rank=rank, world_size=world,
                           global_step=step, max_steps=max_steps, loggers=list(loggers))


def _recorder():
    from loom.tracking.recorder import Recorder

    return Recorder(log_every=1, samples_per_step=8, seq_len=128, flops_per_token=None, peak_flops_per_device=None,
                    world_size=1)


def _module(cfg):
    from loom.models import build_module

    torch.manual_seed(0)
    module = build_module(cfg)
    module.configure_model()  # no trainer: the plain model on the CPU
    return module


def test_the_steps_evaluated_are_every_n_and_the_last_once_after_the_attempts_start(tmp_path):
    ev = Evaluation(_cfg("eval.every_n_steps=3"), tmp_path, 0, SimpleNamespace(phase="training"), _recorder())
    assert [s for s in range(0, 11) if ev.due(s, 10)] == [3, 6, 9, 10]
    ev.start_step = ev.last_step = 6  # resumed at step 6: step 6 itself was scored before
    assert [s for s in range(6, 11) if ev.due(s, 10)] == [9, 10]
    ev.last_step = 9  # accumulation: step 9's later micro batches are not scored again
    assert not ev.due(9, 10)
    end_only = Evaluation(_cfg("eval.at_end=false", "eval.every_n_steps=4"), tmp_path, 0, None, _recorder())
    assert [s for s in range(1, 11) if end_only.due(s, 10)] == [4, 8]


def test_a_failing_evaluation_is_reported_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """The engine raising inside an evaluation: one ERROR paragraph naming the step and the task,
    the entry {step, error} for summary.json, no result file, the time apart from training, the
    network back in training mode, and the callback returns (the loop goes on)."""
    import loom.eval.engine as engine

    def broken(*args, **kwargs):
        raise RuntimeError("the harness broke\nsecond line")

    monkeypatch.setattr(engine, "evaluate", broken)
    cfg = _cfg("eval.every_n_steps=4")
    module, recorder, progress = _module(cfg), _recorder(), SimpleNamespace(phase="training")
    module.model.train()
    ev = Evaluation(cfg, tmp_path, 0, progress, recorder)
    with caplog.at_level(logging.ERROR, logger="loom"):
        ev.on_train_batch_end(_trainer(step=4), module, None, None, 0)
    assert ev.results == [{"step": 4, "error": "RuntimeError: the harness broke"}]
    assert [r.getMessage() for r in caplog.records] == [
        "evaluation at step 4 failed (eval.tasks: tinycode_mc): RuntimeError: the harness broke. Training "
        "continues; summary.json's eval has the error at step 4."]
    assert not (tmp_path / "eval").exists()
    assert module.model.training and progress.phase == "training"
    assert recorder.clock.eval_s > 0 and recorder.val_window == recorder.clock.eval_s


def test_an_evaluation_in_place_scores_and_records_the_step(tmp_path):
    """Single process, the model held whole: scored in place by the real engine, the RESULT at
    eval/step-0000004.json with source loop, eval/<task>/<metric> to the trackers at step 4."""
    cfg = _cfg("eval.every_n_steps=4")
    module, recorder = _module(cfg), _recorder()
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer = _trainer(step=4, loggers=[logger])
    assert held_whole(trainer, module)
    state = torch.random.get_rng_state()
    ev = Evaluation(cfg, tmp_path, 0, SimpleNamespace(phase="training"), recorder)
    ev.on_train_batch_end(trainer, module, None, None, 0)
    assert torch.equal(torch.random.get_rng_state(), state)  # lm-eval's seeding is undone
    [entry] = ev.results
    assert entry["step"] == 4 and "error" not in entry, entry
    saved = json.loads((tmp_path / "eval" / "step-0000004.json").read_text())
    assert saved["source"] == "loop" and saved["tasks"] == entry["tasks"]
    [(step, metrics)] = logged
    assert step == 4 and "eval/tinycode_mc/acc" in metrics, metrics
    assert metrics["eval/tinycode_mc/acc"] == entry["tasks"]["tinycode_mc"]["metrics"]["acc"]


def test_the_unsharded_copy_of_a_lora_llama_holds_its_adapters():
    """The copy a sharded run's evaluation scores (built on meta, adapters injected under
    training's names, the gathered state assigned): the same logits as the trained network, whose
    adapters are made non-zero so that leaving them out would show."""
    cfg = resolve(["hardware=cpu", "model=llama_tiny", "model.lora.r=4", "model.lora.alpha=8", *EVAL])
    module = _module(cfg)
    net = module.model.eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    copy = full_copy(module, state, torch.device("cpu")).eval()
    assert not any(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(copy(ids), net(ids))


# --- FSDP2 on 2 spawned gloo ranks ------------------------------------------------------------------


def gather_worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank of a 2-rank FSDP2 gpt_tiny: the gathered copy on rank 0 against the same model
    unsharded, and a failing evaluation's entry as both ranks leave the wait."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        cfg = _cfg("eval.every_n_steps=2")
        module = _module(cfg)
        reference = _module(cfg).model  # the same seed: the same weights, unsharded
        mesh = init_device_mesh("cpu", (2,))
        for unit in [m for m in module.model.modules() if isinstance(m, module.sharding_units)]:
            fully_shard(unit, mesh=mesh)
        fully_shard(module.model, mesh=mesh)
        trainer = _trainer(rank, 2, step=2)
        out["held_whole"] = held_whole(trainer, module)
        state = gather_state(trainer, module)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        if rank == 0:
            copy = full_copy(module, state, torch.device("cpu")).eval()
            with torch.no_grad():
                out["equal"] = torch.equal(copy(ids), reference.eval()(ids))
        else:
            out["state"] = state
        import loom.eval.engine as engine

        def broken(*args, **kwargs):
            raise ValueError("no such metric")

        engine.evaluate = broken  # rank 0 fails; rank 1 must still leave the wait with its outcome
        ev = Evaluation(cfg, Path(out_dir), rank, SimpleNamespace(phase="training"), _recorder())
        out["entry"] = ev.run(trainer, module, 2)  # every rank gathers, rank 0 scores, all get its outcome
        dist.destroy_process_group()
    except BaseException:  # report instead of leaving the other rank to time out silently
        import traceback

        torch.save({"traceback": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        os._exit(1)
    torch.save(out, Path(out_dir) / f"{rank}.pt")


def test_fsdp2_weights_gather_to_rank_0_and_a_failure_reaches_every_rank(tmp_path):
    import torch.multiprocessing as mp

    context = mp.start_processes(gather_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                                 start_method="spawn", join=False)
    deadline = time.monotonic() + 300
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.terminate()
                raise AssertionError("the 2 ranks did not finish within 300 s")
    except mp.ProcessExitedException:
        errors = [torch.load(f, weights_only=False).get("traceback") for f in sorted(tmp_path.glob("*.pt"))]
        raise AssertionError("\n".join(e for e in errors if e)) from None
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["held_whole"] is False and r1["held_whole"] is False
    assert r0["equal"] is True and r1["state"] is None  # the whole model on rank 0 alone
    assert r0["entry"] == {"step": 2, "error": "ValueError: no such metric"}
    assert r1["entry"] == r0["entry"]


# --- the DDP run of tests/test_tracking.py (eval.tasks=[tinycode_mc] at steps 8 and 12) ---------------


@launching_fixture(scope="module")
def ddp_run(shared):
    r = shared.get(*DDP_ARGS, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    return r


def test_the_loop_records_each_evaluation_in_files_trackers_and_summary(ddp_run):
    run, s = ddp_run.run_dir, ddp_run.summary()
    steps = [EVAL_EVERY, STEPS]
    assert sorted(p.name for p in (run / "eval").glob("step-*.json")) == [f"step-{n:07d}.json" for n in steps]
    assert [e["step"] for e in s["eval"]] == steps and not any("error" in e for e in s["eval"])
    for entry in s["eval"]:
        saved = json.loads((run / "eval" / f"step-{entry['step']:07d}.json").read_text())
        assert saved["source"] == "loop" and saved["tasks"] == entry["tasks"]
        task = entry["tasks"]["tinycode_mc"]
        assert task["samples"] == 20 and 0 <= task["metrics"]["acc"] <= 1 and "acc" in task["stderr"]
    rows = [r for r in ddp_run.metrics() if r.get("eval/tinycode_mc/acc")]
    assert [int(r["step"]) for r in rows] == steps
    assert [float(r["eval/tinycode_mc/acc"]) for r in rows] == pytest.approx(
        [e["tasks"]["tinycode_mc"]["metrics"]["acc"] for e in s["eval"]])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events_file] = (run / "tensorboard").glob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/tinycode_mc/acc")] == steps  # every tracker, not only the csv
    log = (run / "logs" / "rank-0.log").read_text()
    assert f"eval at step {EVAL_EVERY} (" in log and f"eval at step {STEPS} (" in log


def test_evaluation_time_is_apart_from_every_step_and_the_steady_rate(ddp_run):
    """summary.json's time split has eval_s (rank 0's evaluation, awaited by rank 1), and no step
    holds it: the step lines' times (log_every_n_steps=1: each step its own window) add up to at
    most train_time_s, which the clock takes eval_s out of on its own; a step window holding an
    evaluation would exceed it by the evaluation's seconds (about 0.5 s here, steps 0.2 s)."""
    s = ddp_run.summary()
    t, span = s["time"], s["attempts"][-1]
    assert t["eval_s"] == span["eval_s"] > 0
    assert sum(e["seconds"] for e in s["eval"]) <= t["eval_s"]  # the engine's seconds inside the callback's
    rows = {int(r["step"]): float(r["perf/step_time_ms"]) for r in ddp_run.metrics() if r.get("perf/step_time_ms")}
    assert sum(rows.values()) / 1000 <= s["train_time_s"] + 0.001
    assert s["throughput"]["steady"] and span["steady_train_s"] <= s["train_time_s"]


@pytest.mark.parametrize("strategy", ["zero3", "fsdp_tp"])
def test_sharded_parity_runs_score_a_gathered_copy_in_the_loop(shared, strategy, tmp_path):
    """The zero3 and fsdp_tp parity runs (tests/conftest.py LOOP_EVAL) score tinycode_mc at steps 5
    and 10 through the gathered whole copy, mid-training and at the end, with no error (their parity
    tests hold the curves unchanged by it). fsdp_tp's step-10 score is the one `loom eval` gives its
    final weights (fp32, read by Loom's network) on a copy of the run: the gather lost nothing."""
    r = shared.get(*strategy_args(strategy))
    assert r.rc == 0, r.err[-3000:]
    s = r.summary()
    assert [e["step"] for e in s["eval"]] == [5, PARITY_STEPS] and not any("error" in e for e in s["eval"])
    assert all(e["tasks"]["tinycode_mc"]["samples"] == 8 for e in s["eval"]) and s["time"]["eval_s"] > 0
    if strategy != "fsdp_tp":  # zero3 exports bf16 final weights: not the loop's fp32 copy
        return
    import shutil

    from test_eval import _loom

    copy = tmp_path / "run"
    shutil.copytree(r.run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "eval"))
    rc, _, err = _loom("eval", str(copy), "--tasks", "tinycode_mc", "--limit", "8")
    assert rc == 0, err[-3000:]
    after = json.loads((copy / "eval" / f"step-{PARITY_STEPS:07d}.json").read_text())["tasks"]["tinycode_mc"]
    assert after["metrics"] == s["eval"][-1]["tasks"]["tinycode_mc"]["metrics"]
