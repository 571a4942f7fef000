"""scripts/bench/baton.py: two processes take turns step by step, each timing its own steps,
and a deliberate slowdown lands in the slowed side's steps only (the estimator of
overhead.py and ddp_parity.py, issue 36). Two small Python processes, no torch, no launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"

STEPS = 12
SIDE = """
import sys, time
sys.path.insert(0, {bench!r})
from baton import Stepper
s = Stepper({dir!r}, {side!r}, {steps}, slow={slow})
windows = []
s.first()
for _ in range({steps}):
    t0 = time.perf_counter()
    time.sleep(0.02)  # the step's work
    windows.append([t0, time.perf_counter()])
    s.boundary()
s.finish({{"windows": windows}})
"""


def _run_pair(tmp_path: Path, slow_a: float = 0.0) -> dict[str, dict]:
    procs = [subprocess.Popen([sys.executable, "-c", SIDE.format(bench=str(BENCH), dir=str(tmp_path), side=side,
                                                                  steps=STEPS, slow=slow)])
             for side, slow in (("b", 0.0), ("a", slow_a))]
    for p in procs:
        assert p.wait(timeout=60) == 0
    return {side: json.loads((tmp_path / f"steps-{side}-0.json").read_text()) for side in ("a", "b")}


def test_the_sides_take_turns_and_time_only_their_own_steps(tmp_path):
    rec = _run_pair(tmp_path)
    spans = sorted((t0, t1, side) for side in ("a", "b") for t0, t1 in rec[side]["windows"])
    assert [s for _, _, s in spans] == ["a", "b"] * STEPS  # a moves first, then strictly in turns
    # one side's work ends before the other side's next step starts: never both at once
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), spans
    for side in ("a", "b"):
        wall = rec[side]["wall_s"]
        assert len(wall) == STEPS and all(0.019 < w < 0.2 for w in wall), wall  # the other side's turn is not in it
        assert all(c < 0.01 for c in rec[side]["cpu_s"]), rec[side]["cpu_s"]  # sleeping costs no CPU


def test_a_slowdown_lands_in_the_slowed_sides_steps(tmp_path):
    import statistics

    rec = _run_pair(tmp_path, slow_a=0.5)
    a, b = (statistics.median(rec[s]["wall_s"]) for s in ("a", "b"))
    assert a / b == pytest.approx(1.5, rel=0.15), (a, b)


def test_the_interval_of_ratios():
    sys.path.insert(0, str(BENCH))
    from _turns import interval

    same = interval([1.0, 1.0, 1.0], log=True)
    assert same["value"] == pytest.approx(1.0) and same["low"] == pytest.approx(1.0)
    r = interval([1.02, 1.04, 1.03, 1.03], log=True)
    assert r["low"] < 1.03 < r["high"] and r["low"] > 1.0 and r["value"] == pytest.approx(1.03, abs=1e-3)
    d = interval([-1.0, 1.0], log=False)
    assert d["value"] == 0 and d["low"] == pytest.approx(-12.706) and d["high"] == pytest.approx(12.706)
