"""`loom plan --rehearse` (issue 29): ranks of a layout built and stepped over torch's fake
process group, no training launch (the rehearsal's own CPU process). gpt_tiny under fsdp,
fsdp_tp, pp (beside replicated data parallelism) and nd at world 8 and 64: the rehearsed
parameter and optimizer bytes per rank are the plan's, scale as 1/dp over the sharded ranks, and (test_rehearsal_matches_real_runs, on the suite's shared
reference runs: no launch of its own) equal what the real CPU runs report in summary.json.
ZeRO layouts (rehearse/zero.py): DeepSpeed's estimators, asked about this run's model, nodes and
offloads, beside the plan."""

from __future__ import annotations

import json

import pytest
from conftest import FAST, GLOBAL_BATCH, PARITY, strategy_args

from loom import strategies
from loom.errors import ConfigError
from loom.pipeline import resolve
from loom.plan import make_plan
from loom.rehearse import default_ranks, rehearse_in_one_process
from loom.rehearse.table import compare_rank

TINY = ["model=gpt_tiny", "hardware=cpu", "dataset.seq_len=64", "dataset.batch_size=8", *FAST]
LAYOUTS = {
    "fsdp": ["strategy=fsdp"],
    "fsdp_tp": ["strategy=fsdp_tp", "strategy.tensor_parallel=2"],
    # strategy=pp is pp == world (gpt_tiny has 2 layers): its layout beside data parallelism is nd's
    "pp": ["strategy=nd", "strategy.pp=2", "strategy.dp_replicate=-1", "strategy.dp_shard=1"],
    "nd": ["strategy=nd", "strategy.tp=2", "strategy.pp=2"],
}


@pytest.fixture(scope="module")
def rehearsed() -> dict:
    """Rank 0 of every layout at world 8 and 64, in one rehearsal process."""
    cfgs = {(name, world): resolve([*TINY, *args, f"hardware.devices={world}"])
            for name, args in LAYOUTS.items() for world in (8, 64)}
    results = rehearse_in_one_process([(cfg, 0) for cfg in cfgs.values()])
    return {key: (cfg, r) for (key, cfg), r in zip(cfgs.items(), results, strict=True)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rehearsed_state_bytes_are_the_plans_and_scale_as_one_over_dp(rehearsed, name):
    got = {}
    for world in (8, 64):
        cfg, r = rehearsed[(name, world)]
        assert "error" not in r, r
        row = compare_rank(make_plan(cfg).to_dict(), r)
        assert row["difference"]["params"] == 0 and row["difference"]["optimizer"] == 0, row
        assert r["bytes"]["optimizer"] == 2 * r["bytes"]["params"] > 0  # AdamW m and v, fp32
        assert r["tracker"] == ("MemTracker" if strategies.layout_of(cfg).pp > 1 else "FSDPMemTracker")
        got[world] = (r["bytes"]["params"], strategies.layout_of(cfg).dp_shard)
    (p8, dp8), (p64, dp64) = got[8], got[64]
    assert p64 * dp64 == p8 * dp8, (got, name)  # 1/dp over the sharded dp ranks (replicas hold it whole)


def test_pipeline_rank_says_which_stage_it_holds(rehearsed):
    cfg, r = rehearsed[("nd", 64)]
    assert r["pp_rank"] == 0 and r["stages"] == [0] and r["blocks"] == [0] and r["in_flight"] == 2
    assert default_ranks(cfg, make_plan(cfg).to_dict()) == [0]  # 1F1B: stage 0 is the fullest


def test_tp_that_does_not_divide_kv_heads_fails_with_the_launchs_message(capsys):
    args = ["model=llama_tiny", "hardware=cpu", "hardware.devices=64", "strategy=fsdp_tp",
            "strategy.tensor_parallel=4", *FAST]
    with pytest.raises(ConfigError) as launch:  # what `loom train` (the launch) refuses with
        resolve(args)
    from loom.cli import main

    assert main(["plan", *args, "--rehearse"]) == 2
    assert str(launch.value) in capsys.readouterr().err
    assert "must divide model.n_kv_heads=2" in str(launch.value)


def test_a_build_failure_is_the_workers_message():
    """A shard unit the model lacks: the strategy's own ValueError, from the rank's build."""
    cfg = resolve([*TINY, "strategy=fsdp", "hardware.devices=8"])
    cfg.strategy.shard_units = ["NoSuchBlock"]
    (r,) = rehearse_in_one_process([(cfg, 0)])
    assert r["error_type"] == "ValueError" and "strategy.shard_units: ['NoSuchBlock']" in r["error"]


# The suite's shared reference runs (conftest / test_pipeline / test_nd): their summary.json
# holds each rank's parameter and optimizer-state bytes, counted from the real shards.
REAL = {
    "fsdp": strategy_args("fsdp"),
    "fsdp_tp": strategy_args("fsdp_tp"),
    "pp": ("strategy=pp", "hardware.devices=2", *PARITY, f"dataset.batch_size={GLOBAL_BATCH}",
           "strategy.pp_schedule=1f1b"),
}


@pytest.mark.launch
@pytest.mark.slow
def test_rehearsal_matches_real_runs(shared):
    jobs, expect = [], []
    for name, args in REAL.items():
        run = shared.get(*args)
        assert run.rc == 0, run.out + run.err
        mem = run.summary()["memory"]
        cfg = resolve(list(args))
        for rank in range(strategies.layout_of(cfg).world):
            jobs.append((cfg, rank))
            expect.append((name, rank, mem["param_bytes_per_rank"][rank], mem["optim_state_bytes_per_rank"][rank]))
    for (name, rank, params, optim), r in zip(expect, rehearse_in_one_process(jobs), strict=True):
        assert (r["bytes"]["params"], r["bytes"]["optimizer"]) == (params, optim), (name, rank, r)


# A 2-rank fsdp gpt_small step (micro batch 16, seq 128): activations dominate its memory. The run
# profiles its one step's allocations (trainer.profile.memory: the CPU allocator's peak per phase,
# above the state the step starts from), which the rehearsal's activation peak must be within
# 25% of. Measured 2026-11-24: rehearsed 146.4 MB, the run's forward peak 146.2 MB, backward 153.8 MB.
SMALL_FSDP = ("model=gpt_small", "strategy=fsdp", "hardware=cpu", "hardware.devices=2", "trainer.max_steps=1",
              "trainer.limit_val_batches=0", "dataset.max_bytes=2000000", "tracking=csv",
              "checkpoint.every_n_steps=0", "trainer.log_every_n_steps=1")


@pytest.mark.launch
@pytest.mark.slow
def test_rehearsed_activations_match_a_real_fsdp_step(shared):
    import json

    run = shared.get(*SMALL_FSDP, "trainer.profile.steps=[1,2]", "trainer.profile.memory=true")
    assert run.rc == 0, run.out + run.err
    phases = json.loads((run.run_dir / "profile" / "summary.json").read_text())["memory_peak_bytes_per_phase"]
    measured = max(phases["forward"]["cpu"], phases["backward"]["cpu"])
    (r,) = rehearse_in_one_process([(resolve(list(SMALL_FSDP)), 0)])
    rehearsed = r["bytes"]["activations"]
    assert abs(rehearsed - measured) <= 0.25 * measured, (rehearsed, phases)
    mem = run.summary()["memory"]  # and the states are the real shards', exactly
    assert (r["bytes"]["params"], r["bytes"]["optimizer"]) == (mem["param_bytes_per_rank"][0],
                                                               mem["optim_state_bytes_per_rank"][0])


def meta_counts(cfg) -> tuple[int, int]:
    """(parameters, elements of the largest one) of the model built on the meta device: what
    DeepSpeed's estimators must be given, counted here without the plan's arithmetic."""
    import torch

    from loom import models

    with torch.device("meta"):
        net = models.build_module(cfg).build_model()
    sizes = [p.numel() for p in net.parameters()]  # a tied embedding and head: once
    return sum(sizes), max(sizes)


# ZeRO layouts: DeepSpeed cannot initialize over a fake process group, so rehearse/zero.py asks
# DeepSpeed's own estimators what a rank holds. What each must be asked: the model's P parameters
# and the L elements of its largest tensor, 8 GPUs per node on 2 nodes (not 16 per node), the
# strategy's offloads, no headroom (additional_buffer_factor 1.0, not DeepSpeed's 1.5). Expected:
# DeepSpeed's formulas (runtime/zero/stage_1_and_2.py, stage3.py), device and host bytes.
ZERO = ["model=llama3_1b", "hardware=h100x8", "hardware.num_nodes=2", "hardware.rdzv_endpoint=node0:29500"]
GPUS, PER_NODE, NODES = 16, 8, 2
ZERO_CASES = {
    # 16-bit params whole; 2 + 4 bytes of grads, 4 of fp32 params, 8 of Adam per parameter over the GPUs
    "zero1": (["strategy=zero1"], "zero2", lambda P, L: (2 * P + int(18 * P / GPUS), 4 * P * PER_NODE)),
    "zero2": (["strategy=zero2"], "zero2", lambda P, L: (2 * P + int(18 * P / GPUS), 4 * P * PER_NODE)),
    "zero2 offload": (["strategy=zero2", "strategy.offload_optimizer=true"], "zero2",
                      lambda P, L: (2 * P, P * max(4 * GPUS, 16))),
    # the largest layer gathered whole in fp32, the rest partitioned
    "zero3": (["strategy=zero3"], "zero3", lambda P, L: (4 * L + int(18 * P / GPUS), 4 * L * PER_NODE)),
    "zero3_offload": (["strategy=zero3_offload"], "zero3", lambda P, L: (4 * L + int(2 * P / GPUS), 16 * P / NODES)),
    "zero3_offload params": (["strategy=zero3_offload", "strategy.offload_params=true"], "zero3",
                             lambda P, L: (4 * L, 18 * P / NODES)),
}


@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_a_zero_rehearsal_asks_deepspeeds_estimators_about_this_run(case):
    from loom.rehearse import rehearse

    args, stage, expect = ZERO_CASES[case]
    cfg = resolve([*ZERO, *args])
    plan = make_plan(cfg).to_dict()
    params, largest = meta_counts(cfg)
    assert plan["params"] == params
    device, host = expect(params, largest)
    r = rehearse(cfg, plan, show=False)
    assert r["estimator"].startswith(f"DeepSpeed estimate_{stage}_model_states_mem_needs"), r
    assert (r["deepspeed_states"], r["deepspeed_host"]) == (device, host), (case, r)
    mem = plan["memory_per_device_bytes"]
    planned = mem["params"] + mem["grads"] + mem["optimizer"]
    assert r["planned_states"] == planned and r["difference"] == pytest.approx((planned - device) / device)
    assert r["world_size"] == GPUS and r["ranks"] == []  # no rank process: nothing to build over a fake group
    assert r["note"] is None  # bf16-mixed: what the estimators count


def test_a_zero_rehearsal_of_an_fp32_run_says_the_estimators_count_16_bit():
    """On CPU (32-true) the plan holds fp32 weights and gradients that DeepSpeed's estimators do not
    count: the rehearsal says why the plan is larger instead of leaving a bare +41% to read as a
    plan error."""
    from loom.rehearse import rehearse

    cfg = resolve(["model=gpt_tiny", "strategy=zero2", "hardware=cpu"])
    r = rehearse(cfg, make_plan(cfg).to_dict(), show=False)
    assert r["note"] == ("DeepSpeed's estimators count 16-bit mixed precision; this run is 32-true (fp32 "
                         "weights and gradients), so the plan's larger figure is expected, not an error")
    assert r["planned_states"] > r["deepspeed_states"]


def test_plan_rehearse_shows_deepspeeds_figures_beside_the_plans(tmp_path, capsys, monkeypatch):
    """`loom plan strategy=zero3 --rehearse`: exit 0, plan.json's rehearsal, and its table."""
    from loom.cli import main
    from loom.rehearse.table import GB

    monkeypatch.setenv("COLUMNS", "200")  # one line per table row
    out = tmp_path / "plan.json"
    assert main(["plan", *ZERO, "strategy=zero3", "--rehearse", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["rehearsal"]
    params, largest = meta_counts(resolve([*ZERO, "strategy=zero3"]))
    assert r["deepspeed_states"] == 4 * largest + int(18 * params / GPUS)
    rows = {cells[0]: cells[1:] for line in capsys.readouterr().out.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 4}
    assert rows["model states (params + grads + optimizer)"] == [
        f"{r['planned_states'] / GB:,.2f}", f"{r['deepspeed_states'] / GB:,.2f}", f"{r['difference']:+.0%}"]
    assert rows["host (CPU) memory per node"] == ["", f"{r['deepspeed_host'] / GB:,.2f}", ""]
