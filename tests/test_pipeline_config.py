"""strategy=pp | nd: the degrees and pipeline options are validated before anything starts
(exit 2 in under a second of work, naming keys, values and what would be valid), and the
static schedule table matches the installed torch."""

from __future__ import annotations

import pytest
from conftest import refused_fast
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
     ["strategy.pp=4", "model.n_layer=2", "strategy.pp <= 2"]),
    (["strategy=pp", "hardware.devices=2", "strategy.pp_schedule=interleaved_1f1b"],
     ["strategy.pp=2", "4 pipeline stages", "2 per rank", "strategy.pp <= 1"]),
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
def test_bad_degrees_refused_fast(loom, tmp_path, args, needles):
    err = refused_fast(loom, tmp_path, *CPU, *args)
    for needle in needles:
        assert needle in err, (needle, err)


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
])
def test_summary_parallel_of_every_strategy(strategy, parallel):
    """summary.json's `parallel` comes from the run's layout, for every strategy (a run that
    never reached training included: the launcher's summary is built the same way)."""
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = OmegaConf.create({"hardware": {"devices": 4, "num_nodes": 2, "name": "cpu"}, "strategy": strategy})
    got = empty_summary(cfg, "r", layout_of(cfg))["parallel"]
    keys = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "pp_microbatches")
    assert got == dict(zip(keys, parallel, strict=True))


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
