"""`loom plan --compare --rehearse` (rehearse/compare.py): the comparison's top three layouts
rehearsed (the fake process group for FSDP2 layouts, DeepSpeed's estimators for ZeRO), their
fit judged again by the rehearsed peak plus the plan's runtime, and re-ranked: the layouts that
fit by their rehearsal first, the comparison's order within each group. No training launch:
`loom plan` runs in this process and rehearses each layout's rank 0 in a CPU process.

The scenario: gpt_tiny over 8 CPU ranks with 5.12 GB of host memory, i.e. 512 MB per rank, of
which the plan's runtime takes 500. The plan fits fsdp, zero3 and nd (2 x 4 hybrid) by a few
MB and ranks them in that order; their rehearsals say fsdp and the hybrid layout peak above the
12 MB left, zero3 below it, so zero3 moves first (measured: 11.3, 12.9 and 13.6 MB)."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
from test_rehearse import meta_counts

from loom.compose import compose
from loom.plan.compare import compare

ARGS = ["model=gpt_tiny", "hardware=cpu", "hardware.devices=8", "dataset.seq_len=64", "dataset.batch_size=8",
        "hardware.host_memory_gb=5.12"]
CAPACITY = 512e6  # 5.12 GB x 0.8 usable / 8 ranks
MB = 1024.0**2


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """(rc, --json rows, console text) of `loom plan --compare --rehearse`, and the comparison
    without the rehearsal."""
    from loom.cli import main

    path = tmp_path_factory.mktemp("compare") / "compare.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--compare", "--rehearse", "--json", str(path), *ARGS])
    return rc, json.loads(path.read_text()), out.getvalue(), compare(compose(ARGS))


def _deepspeed_zero3_bytes(params: int, largest: int, gpus: int) -> int:
    """DeepSpeed's estimate_zero3_model_states_mem_needs without offload: the largest layer in
    fp32 plus 18 bytes per parameter over the GPUs (16-bit params and grads, fp32 grads, master,
    m and v)."""
    return 4 * largest + int(18 * params / gpus)


def _rehearsed_peak(row: dict, cand) -> float:
    """The peak the re-ranking must judge, from the rehearsal's own parts."""
    plan = cand.plan.to_dict()
    if row["rehearsal"].get("estimator"):
        assert cand.strategy == "zero3"
        params, largest = meta_counts(cand.cfg)
        assert plan["params"] == params
        return _deepspeed_zero3_bytes(params, largest, 8) + plan["memory_per_device_bytes"]["activations"]
    ranks = row["rehearsal"]["ranks"]
    assert [r["rank"] for r in ranks] == [0] and "error" not in ranks[0], ranks  # rank 0, no pipeline
    return ranks[0]["bytes"]["peak"]


def test_the_top_three_are_rehearsed_and_refit_by_their_rehearsed_peaks(compared):
    rc, rows, _, plain = compared
    assert rc == 0
    top = plain.candidates[:3]
    assert [c.strategy for c in top] == ["fsdp", "zero3", "nd"], [c.overrides for c in top]
    assert all(c.fits and c.capacity_per_device_bytes == pytest.approx(CAPACITY) for c in top)
    by_layout = {" ".join(r["overrides"]): r for r in rows[:3]}
    assert sorted(by_layout) == sorted(" ".join(c.overrides) for c in top)
    fits = {}
    for cand in top:
        row = by_layout[" ".join(cand.overrides)]
        runtime = cand.plan.to_dict()["memory_per_device_bytes"]["runtime"]
        assert runtime == 500e6  # the plan's per-process runtime on CPU, added to the rehearsed peak
        peak = _rehearsed_peak(row, cand)
        assert row["rehearsed_peak_bytes"] == pytest.approx(peak, abs=0.5), cand.overrides
        assert row["fits_rehearsed"] is (peak + runtime <= CAPACITY), (cand.overrides, peak)
        fits[cand.strategy] = row["fits_rehearsed"]
    assert fits == {"fsdp": False, "zero3": True, "nd": False}  # the scenario the docstring names


def test_layouts_that_fit_by_their_rehearsal_come_first_in_the_comparisons_order(compared):
    _, rows, _, plain = compared
    order = [" ".join(c.overrides) for c in plain.candidates[:3]]
    fit = [o for o in order if next(r for r in rows[:3] if " ".join(r["overrides"]) == o)["fits_rehearsed"]]
    assert [" ".join(r["overrides"]) for r in rows[:3]] == fit + [o for o in order if o not in fit]
    assert rows[0]["overrides"] == ["strategy=zero3"]  # moved ahead of fsdp, which the plan ranked first


def test_the_rest_are_the_comparisons_rows_untouched(compared):
    _, rows, _, plain = compared
    assert len(rows) == len(plain.candidates) > 3
    assert rows[3:] == [json.loads(json.dumps(c.to_dict())) for c in plain.candidates[3:]]
    assert not any("rehearsal" in r or "fits_rehearsed" in r for r in rows[3:])


def test_the_table_shows_what_was_judged(compared):
    """One row per rehearsed layout in the new order: the plan's total and the rehearsed peak
    plus the same runtime, both in MB (every figure is under 1 GB), and the verdict."""
    _, rows, text, plain = compared
    assert ("the top 3 layouts rehearsed, re-ranked by their rehearsed peaks (+ the plan's runtime, capacity "
            "488.28 MB per device)") in " ".join(text.split())  # the title, however the console wraps it
    plans = {" ".join(c.overrides): c.plan.to_dict() for c in plain.candidates[:3]}
    lines = [line for line in text.splitlines() if re.match(r"│ \d │", line)]
    assert [line.split("│")[1].strip() for line in lines] == ["1", "2", "3"]
    for line, row in zip(lines, rows[:3], strict=True):
        cells = [c.strip() for c in line.split("│")[1:-1]]
        runtime = plans[" ".join(row["overrides"])]["memory_per_device_bytes"]["runtime"]
        assert cells[1].startswith(row["overrides"][0])
        assert cells[2:5] == [f"{row['memory_per_device_bytes'] / MB:,.2f}",
                              f"{(row['rehearsed_peak_bytes'] + runtime) / MB:,.2f}",
                              "yes" if row["fits_rehearsed"] else "no"], line
