"""Stragglers: a rank slower than the median rank in its own work (data wait + forward) at
`tracking.straggler_window` consecutive log steps is named once on the console and in
summary.json `stragglers`, with its cause; `loom report` draws the ranks x steps heatmap.

One launch of its own (4 ranks, 6 steps of the digits classifier): rank 2 sleeps in its
training_step (compute), rank 3 before its batch is handed over (data). The fair run is
tests/test_tracking.py's shared ddp_run (no straggler)."""

from __future__ import annotations

import json

import pytest
from conftest import FAST, launching_fixture, refused, run_loom
from test_tracking import DDP_ARGS, SENTINELS, STEPS
from tests_helpers import helpers_env

pytestmark = pytest.mark.slow

SLOW = [*(o for o in FAST if not o.startswith("dataset.")), "dataset=digits", "model=custom",
        "model.module._target_=tests_helpers.StragglerLit", "+model.module.compute_rank=2",
        "+model.module.data_rank=3", "+model.module.delay=0.3", "security.allow_targets=[tests_helpers.]",
        "hardware=cpu", "hardware.devices=4", "trainer.max_steps=6", "tracking.straggler_window=3"]


@launching_fixture(scope="module")
def slow_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stragglers")
    r = run_loom("train", *SLOW, root=root, env=helpers_env(root))
    assert r.rc == 0, r.out + r.err
    return r


def test_slow_ranks_are_named_once_with_their_cause(slow_run):
    s = slow_run.summary()
    found = {x["rank"]: x for x in s["stragglers"]}
    assert sorted(found) == [2, 3], s["stragglers"]
    assert found[2]["cause"] == "compute" and found[3]["cause"] == "data"
    for x in found.values():
        assert x["slowdown"] > 0.2 and x["host"] and 1 <= x["first_step"] <= 4
    lines = [line for line in slow_run.out.splitlines() if line.startswith("Straggler: rank")]
    assert len(lines) == 2, slow_run.out  # once each, on the console
    assert "rank 2 on " in lines[0] + lines[1] and "data loader" in "".join(x for x in lines if "rank 3" in x)


def test_the_report_draws_the_ranks_heatmap(slow_run):
    rows = [json.loads(line) for line in (slow_run.run_dir / "ranks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(len(r["compute_ms"]) == 4 for r in rows)
    r = run_loom("report", str(slow_run.run_dir), root=slow_run.run_dir.parents[1])
    assert r.rc == 0, r.out + r.err
    md = (slow_run.run_dir / "report.md").read_text()
    assert "## Ranks" in md and "![ranks](plots/ranks.png)" in md
    assert "| 2 |" in md and "| compute |" in md and "| data |" in md
    png = (slow_run.run_dir / "plots" / "ranks.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_fair_run_names_no_straggler(shared):
    r = shared.get(*DDP_ARGS, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    assert r.summary()["stragglers"] == [] and "Straggler:" not in r.out
    assert len((r.run_dir / "ranks.jsonl").read_text().splitlines()) >= STEPS


@pytest.mark.parametrize(("override", "key"), [("tracking.straggler_threshold=0", "tracking.straggler_threshold"),
                                               ("tracking.straggler_window=0", "tracking.straggler_window")])
def test_bad_straggler_settings_are_refused(tmp_path, override, key):
    assert f"{key}=" in refused(tmp_path, "hardware=cpu", "tracking=csv", override)


def test_the_rule_on_synthetic_rows():
    """Lower median reference; the streak must be unbroken; named once; cause by the larger excess."""
    from loom.tracking.stragglers import StragglerWatch

    w = StragglerWatch(None, threshold=0.2, window=2, hosts=["a", "b", "c"])
    step = [100.0] * 3
    w.update(1, step, [1, 1, 1], [10, 10, 40])   # rank 2: +30% of a step, in compute
    w.update(2, step, [1, 1, 1], [10, 10, 15])   # streak broken
    w.update(3, step, [1, 1, 1], [10, 10, 40])
    assert w.found == []
    w.update(4, step, [1, 1, 1], [10, 10, 40])
    w.update(5, step, [1, 1, 1], [10, 10, 40])
    assert w.found == [{"rank": 2, "host": "c", "slowdown": 0.3, "cause": "compute", "first_step": 3}]
