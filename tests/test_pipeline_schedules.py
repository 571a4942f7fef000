"""Every pipeline schedule trains like `single` (CPU, gloo, real processes), and the schedule
options torch would reject at the first step are refused before anything starts.

One `single` run of an 8-block gpt_tiny is the reference for all of them, this module's own and
not the shared `single` (conftest.SINGLE, 2 blocks): a multi-stage schedule needs 2 pp stages of
at least one block each, 8 for interleaved 1F1B at pp 4, so no run here can use a 2-block
model, and comparing with a single of another model would compare nothing. The multi-stage
schedules at pp 2 (4 stages of 2 blocks; gpipe and 1f1b at pp 2 are in tests/test_pipeline.py)
and interleaved 1F1B at pp 4 (8 stages of 1 block). Every run reads the same global batch of 4,
so step-1 loss, the last step's and the validation loss (the schedule's forward-only `eval`)
must agree within 1e-4. The microbatch counts differ on purpose: fewer than the V schedule's
2 pp - 1 (zbv), two rounds of pp (interleaved zero bubble), one round (interleaved 1F1B).
"""

from __future__ import annotations

import re

import pytest
from conftest import FAST, LoomResult, launching_fixture, refused, run_loom

STEPS = 3
ARGS = [*FAST, "hardware=cpu", "model=gpt_tiny", "model.n_layer=8", f"trainer.max_steps={STEPS}",
        "dataset.batch_size=4", "dataset.seq_len=64"]
# name -> (pipeline ranks, microbatches, each rank's stages)
SCHEDULES = {
    "interleaved_1f1b": (2, 2, [[0, 2], [1, 3]]),
    "interleaved_zero_bubble": (2, 4, [[0, 2], [1, 3]]),
    "zbv_zero_bubble": (2, 2, [[0, 3], [1, 2]]),          # V-shaped: rank 0 holds the first and the last
    "interleaved_1f1b@pp4": (4, 4, [[0, 4], [1, 5], [2, 6], [3, 7]]),
}


@launching_fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, LoomResult]:
    root = tmp_path_factory.mktemp("schedules")
    out = {"single": run_loom("train", "strategy=single", "hardware.devices=1", *ARGS, root=root)}
    for key, (pp, mb, _) in SCHEDULES.items():
        out[key] = run_loom("train", "strategy=pp", f"hardware.devices={pp}", f"strategy.pp_schedule={key.split('@')[0]}",
                            f"strategy.pp_microbatches={mb}", *ARGS, root=root)
    for r in out.values():
        assert r.rc == 0, r.out + r.err
    return out


@pytest.mark.parametrize("key", list(SCHEDULES))
def test_schedule_matches_single(runs, key):
    single, pp = runs["single"].losses(), runs[key].losses()
    assert sorted(pp) == list(range(1, STEPS + 1))
    for step in (1, STEPS):
        assert abs(pp[step] - single[step]) < 1e-4, (step, pp[step], single[step])
    assert pp[STEPS] < pp[1] - 0.3  # it trains
    val, ref = runs[key].summary()["validation"]["loss"], runs["single"].summary()["validation"]["loss"]
    assert abs(val - ref) < 1e-4, (val, ref)


@pytest.mark.parametrize("key", list(SCHEDULES))
def test_stage_placement(runs, key):
    """Looped placement (r, r + pp) for the interleaved schedules, V-shaped (r, 2 pp - 1 - r) for zbv."""
    pp, mb, stages = SCHEDULES[key]
    s = runs[key].summary()["parallel"]
    assert (s["pp"], s["pp_schedule"], s["pp_microbatches"]) == (pp, key.split("@")[0], mb)
    for rank, want in enumerate(stages):
        log = (runs[key].run_dir / "logs" / f"rank-{rank}.log").read_text()
        got = re.search(rf"pipeline: rank {rank}/{pp} runs stages \[([\d, ]+)\] of {2 * pp}", log)
        assert got and [int(x) for x in got.group(1).split(",")] == want, (rank, got and got.group(0))


@pytest.mark.parametrize("args, needles", [
    # torch's interleaved schedules run max(1, m // pp) equal rounds; 5 microbatches at pp 2 is 2 rounds
    (["strategy.pp_schedule=interleaved_1f1b", "strategy.pp_microbatches=5", "dataset.batch_size=10"],
     ["strategy.pp_microbatches=5", "interleaved_1f1b", "multiple of 2", "valid with dataset.batch_size=10: 2, 10"]),
    (["strategy.pp_schedule=interleaved_zero_bubble", "strategy.pp_microbatches=7", "dataset.batch_size=14"],
     ["strategy.pp_microbatches=7", "multiple of 3", "2, 14"]),
    (["hardware.precision=16-mixed"],
     ["hardware.precision='16-mixed'", "strategy.pp=2", "gradient scaler", "32-true, bf16-mixed, bf16-true"]),
])
def test_pipeline_options_refused(tmp_path, args, needles):
    err = refused(tmp_path, "hardware=cpu", "model=gpt_tiny", "model.n_layer=4", "strategy=pp",
                       "hardware.devices=2", *args)
    for needle in needles:
        assert needle in err, (needle, err)
