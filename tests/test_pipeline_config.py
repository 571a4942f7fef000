"""strategy=pp | nd: the degrees and pipeline options are validated before anything starts
(exit 2 in under a second of work, naming keys, values and what would be valid), and the
static schedule table matches the installed torch."""

from __future__ import annotations

import re

import pytest
from conftest import refused
from omegaconf import OmegaConf

CPU = ["hardware=cpu", "model=gpt_tiny"]


@pytest.mark.parametrize("args, needles", [
    (["strategy=nd", "strategy.dp_shard=2", "strategy.tp=2", "strategy.pp=2", "hardware.devices=4"],
     ["strategy.dp_shard=2 x strategy.tp=2 x strategy.pp=2 = 8", "world size 4", "-1"]),
    (["strategy=nd", "strategy.dp_shard=-1", "strategy.pp=-1", "hardware.devices=4"],
     ["only one degree may be -1", "strategy.dp_shard, strategy.pp"]),
    (["strategy=nd", "strategy.dp_shard=-1", "strategy.tp=3", "hardware.devices=6"],
     ["strategy.tp=3", "model.n_head=4", "valid: 1, 2, 4"]),
    (["strategy=nd", "strategy.dp_shard=-1", "strategy.pp=3", "hardware.devices=4"],
     ["strategy.dp_shard=-1", "multiply to 3", "valid products: 1, 2, 4"]),
    (["strategy=pp", "hardware.devices=4"],
     ["strategy.pp=4", "model.n_layer=2", "use model.n_layer=4"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_schedule=interleaved_1f1b"],
     ["strategy.pp=2", "4 pipeline stages", "2 per rank", "use model.n_layer=4", "strategy.pp_schedule=1f1b"]),
    (["strategy=pp", "hardware.devices=2", "model.n_layer=4", "strategy.pp_microbatches=1"],
     ["strategy.pp_microbatches=1", "valid: >= 2"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_microbatches=3", "dataset.batch_size=8"],
     ["strategy.pp_microbatches=3", "dataset.batch_size=8", "1, 2, 4, 8"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_schedule=zero_bubble"],
     ["strategy.pp_schedule='zero_bubble'", "gpipe, 1f1b, interleaved_1f1b"]),
    (["strategy=pp", "hardware.devices=2", "trainer.accumulate_grad_batches=2"],
     ["trainer.accumulate_grad_batches=2", "strategy.pp_microbatches"]),
    (["strategy=pp", "hardware.devices=2", "model=mlp", "dataset=digits"],
     ["strategy.pp=2", "cannot be split into pipeline stages"]),
    (["strategy=nd", "strategy.dp_shard=0", "hardware.devices=2"],
     ["strategy.dp_shard=0", "positive integer, or -1"]),
])
def test_bad_degrees_refused(tmp_path, args, needles):
    err = refused(tmp_path, *CPU, *args)
    for needle in needles:
        assert needle in err, (needle, err)


# A refusal whose message names a fix, and that fix: applied, the config must be accepted.
HINTS = [
    (["strategy=pp", "hardware.devices=4"], ["model.n_layer=4"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_schedule=interleaved_1f1b"], ["model.n_layer=4"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_schedule=interleaved_1f1b"], ["strategy.pp_schedule=1f1b"]),
    (["strategy=nd", "strategy.dp_shard=-1", "strategy.tp=3", "hardware.devices=6"], ["strategy.tp=2"]),
    (["strategy=pp", "hardware.devices=2", "model.n_layer=4", "strategy.pp_microbatches=1"],
     ["strategy.pp_microbatches=2"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_microbatches=3", "dataset.batch_size=8"],
     ["strategy.pp_microbatches=4"]),
    (["strategy=fsdp_tp", "hardware.devices=2", "strategy.tensor_parallel=3"], ["strategy.tensor_parallel=2"]),
    (["strategy=fsdp_tp", "hardware.devices=4", "strategy.tensor_parallel=3"], ["strategy.tensor_parallel=4"]),
]


@pytest.mark.parametrize("args, fix", HINTS)
def test_a_suggested_fix_is_accepted(tmp_path, args, fix):
    from loom.pipeline import resolve

    err = refused(tmp_path, *CPU, *args)
    key, _, value = fix[0].partition("=")
    assert re.search(rf"{re.escape(key)}(=|: |.*valid.*\b){re.escape(value)}\b|valid choices: .*\b{value}\b", err), err
    resolve([*CPU, *args, *fix])  # no ConfigError


def test_a_tensor_parallel_degree_that_cannot_split_the_heads_suggests_no_device_count(tmp_path):
    err = refused(tmp_path, *CPU, "strategy=fsdp_tp", "hardware.devices=2", "strategy.tensor_parallel=3")
    assert "hardware.devices=3" not in err and "cannot split model.n_head=4" in err and "valid choices: 1, 2" in err


def test_the_plans_fewer_processes_hint_is_one_train_accepts(monkeypatch):
    """`loom plan`'s no-fit hint on CPU names at most what `loom train` starts on this machine,
    even where host memory alone would allow far more processes."""
    from loom.errors import ConfigError
    from loom.hardware import machine
    from loom.pipeline import resolve
    from loom.plan import render

    limit = machine.cpu_process_limit()
    monkeypatch.setattr(render, "_cpu_host_need", lambda _plan: 2**30)  # 1 GB per process
    text = render._no_fit_hint({"accelerator": "cpu", "host_capacity_bytes": 100 * limit * 2**30,
                                "devices_per_node": 10 * limit})
    most = int(re.search(r"hardware.devices<=(\d+)", text)[1])
    assert most == limit
    machine.check_machine(resolve(["hardware=cpu", f"hardware.devices={most}"]))
    with pytest.raises(ConfigError, match=f"hardware.devices<={limit}"):
        machine.check_machine(resolve(["hardware=cpu", f"hardware.devices={most + 1}"]))


def _cfg(**strategy) -> object:
    return OmegaConf.create({"hardware": {"devices": 4, "num_nodes": 2}, "strategy": strategy})


def test_layout_fills_the_free_degree():
    """The one -1 is the rest of the world; `pp` is the preset pp=-1 (everything else 1)."""
    from loom.strategies import layout_of

    lay = layout_of(_cfg(name="nd", dp_replicate=2, dp_shard=-1, tp=2, pp=1))
    assert (lay.world, lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp) == (8, 2, 2, 2, 1)
    lay = layout_of(_cfg(name="pp", pp=-1))
    assert (lay.dp, lay.tp, lay.pp) == (1, 1, 8)
    lay = layout_of(_cfg(name="ddp"), name="nd")  # plan weighing nd with its defaults: all shard
    assert (lay.dp_shard, lay.tp, lay.pp) == (8, 1, 1)


@pytest.mark.parametrize("strategy, parallel", [
    ({"name": "pp", "pp": -1, "pp_schedule": "gpipe", "pp_microbatches": 16}, (1, 1, 1, 8, "gpipe", 16)),
    ({"name": "pp", "pp": -1, "pp_schedule": "1f1b", "pp_microbatches": None}, (1, 1, 1, 8, "1f1b", 8)),
    ({"name": "nd", "dp_replicate": 2, "dp_shard": -1, "tp": 2, "pp": 1, "pp_schedule": "1f1b",
      "pp_microbatches": None}, (2, 2, 2, 1, None, None)),
    ({"name": "ddp"}, (8, 1, 1, 1, None, None)),
    ({"name": "fsdp_tp", "tensor_parallel": 2}, (1, 4, 2, 1, None, None)),
    ({"name": "fsdp", "hybrid_shard": True}, (2, 4, 1, 1, None, None)),
    ({"name": "fsdp", "hybrid_shard": False, "ep": 4}, (1, 8, 1, 1, None, None, 4)),
])
def test_summary_parallel_of_every_strategy(strategy, parallel):
    """summary.json's `parallel` comes from the run's layout, for every strategy (a run that
    never reached training included: the launcher's summary is built the same way)."""
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = OmegaConf.create({"hardware": {"devices": 4, "num_nodes": 2, "name": "cpu"}, "strategy": strategy})
    got = empty_summary(cfg, "r", layout_of(cfg))["parallel"]
    keys = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "pp_microbatches", "ep")
    want = dict(zip(keys, (*parallel, 1)[:len(keys)], strict=True))  # ep 1 unless the case says
    assert got == {**want, "cp": 1, "cp_style": None}


def test_schedule_table_matches_torch():
    """Validation's static table (no torch import) names schedules the installed torch has, with
    the right number of stages per rank (single-stage vs multi-stage schedule classes)."""
    from torch.distributed.pipelining import schedules

    from loom.strategies.degrees import PP_SCHEDULES

    for name, sched in PP_SCHEDULES.items():
        cls = getattr(schedules, sched.torch_class, None)
        assert cls is not None, f"{name}: torch has no {sched.torch_class}"
        multi = issubclass(cls, schedules.PipelineScheduleMulti)
        assert multi == (sched.stages_per_rank > 1), name
    assert {"gpipe", "1f1b", "interleaved_1f1b"} <= set(PP_SCHEDULES)


# ----------------------------------------------------------------------------- plan


def test_bubble_fraction():
    """(p-1)/(v*m+p-1): the idle share of a step, the interleaved schedule dividing the fill/drain by v."""
    from loom.plan.pipeline import bubble_fraction

    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, per_rank=2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 32) < bubble_fraction(4, 8)  # more microbatches, smaller bubble


def _plan(*overrides: str) -> dict:
    from loom.pipeline import resolve
    from loom.plan import make_plan

    return make_plan(resolve(["hardware=cpu", "model=gpt_tiny", "model.n_layer=8", "dataset.batch_size=8",
                              "dataset.seq_len=64", *overrides])).to_dict()


@pytest.mark.parametrize("schedule, flight", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8, 8, 8, 8])])
def test_plan_per_stage_memory(schedule, flight):
    """Each pipeline rank holds its blocks' states (embeddings on the first, the head on the
    last) and the activations of its microbatches in flight: under 1F1B the first stage holds
    pp of them (the most), under GPipe every stage holds all m. The device total is the
    fullest stage's."""
    from loom.models.gpt import spec as gpt_spec
    from loom.pipeline import resolve

    plan = _plan("strategy=pp", "hardware.devices=4", f"strategy.pp_schedule={schedule}", "strategy.pp_microbatches=8")
    pipe = plan["pipeline"]
    assert plan["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 4, "ep": 1, "cp": 1,
                                "cp_style": None, "pp_schedule": schedule,
                                "pp_microbatches": 8}
    assert pipe["bubble_fraction"] == pytest.approx(3 / 11)
    stages = pipe["stages"]
    assert [s["blocks"] for s in stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [(s["embeddings"], s["head"]) for s in stages] == [(True, False), (False, False), (False, False),
                                                              (False, True)]
    assert [s["microbatches_in_flight"] for s in stages] == flight
    cfg = resolve(["model=gpt_tiny", "model.n_layer=8", "dataset.seq_len=64"])
    assert sum(s["params"] for s in stages) == gpt_spec(cfg.model, 64).params
    for s in stages:  # fp32 AdamW, one replica: 4 + 4 + 8 bytes per parameter of the stage
        assert s["memory_bytes"]["states"] == pytest.approx(16 * s["params"])
    act = [s["memory_bytes"]["activations"] for s in stages]
    if schedule == "1f1b":
        assert act[0] > act[1] > act[2]  # the first stage holds the most activations
    else:
        assert act[0] == act[1] == act[2] < act[3]  # every microbatch everywhere, + logits on the last
    worst = max(stages, key=lambda s: s["memory_bytes"]["total"])["memory_bytes"]
    mem = plan["memory_per_device_bytes"]
    assert mem["total"] == pytest.approx(worst["total"] + mem["runtime"])
    assert plan["comm_bytes_by_collective"]["pipeline_send"] == pytest.approx(2 * 8 * 64 * 128 * 4)  # b s d, fp32


def test_plan_interleaved_and_nd():
    """Interleaved: two looped stages per rank, the bubble divided accordingly; nd shards each
    stage's states over dp_shard. Without a pipeline the plan has none."""
    plan = _plan("strategy=pp", "hardware.devices=2", "strategy.pp_schedule=interleaved_1f1b",
                 "strategy.pp_microbatches=4")
    pipe = plan["pipeline"]
    assert [s["stages"] for s in pipe["stages"]] == [[0, 2], [1, 3]]
    assert [s["blocks"] for s in pipe["stages"]] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert pipe["bubble_fraction"] == pytest.approx(1 / 9)
    from loom.layout import ParallelLayout
    from loom.pipeline import resolve
    from loom.plan.pipeline import stage_plans

    cfg = resolve(["hardware=cpu", "model=gpt_tiny", "model.n_layer=8", "strategy=pp", "hardware.devices=2"])
    pp = stage_plans(cfg, "pp", ParallelLayout(2, 2, pp=2, pp_schedule="1f1b", pp_microbatches=2))
    nd = stage_plans(cfg, "nd", ParallelLayout(4, 4, dp_shard=2, pp=2, pp_schedule="1f1b", pp_microbatches=2))
    for a, b in zip(nd, pp, strict=True):  # (nd with dp_shard x pp is planned before it trains)
        assert a.memory_bytes["states"] == pytest.approx(b.memory_bytes["states"] / 2)
    assert _plan("strategy=ddp")["pipeline"] is None


def test_loom_plan_shows_the_pipeline(loom):
    r = loom("plan", "hardware=cpu", "model=gpt_tiny", "model.n_layer=4", "strategy=pp", "hardware.devices=2",
             "dataset.batch_size=4", env={"COLUMNS": "240"})
    assert r.rc == 0, r.out + r.err
    out = " ".join(r.out.split())
    assert "bubble 33.3%" in out and "pp rank 0" in out and "blocks 0-1 + embeddings" in out
    assert "2 microbatch(es) in flight" in out
