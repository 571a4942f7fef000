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
        assert p.wait(timeout=300) == 0
    return {side: json.loads((tmp_path / f"steps-{side}-0.json").read_text()) for side in ("a", "b")}


WORK_S = 0.02  # each step's sleep in SIDE


def _steps(rec: dict) -> list[tuple[float, float]]:
    """A side's steps as its own clock saw them: [start, start + wall] on the machine's monotonic clock."""
    return [(t0, t0 + w) for t0, w in zip(rec["started_s"], rec["wall_s"], strict=True)]


def _overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


# No assertion here reads a duration against a bound that load can break (issue 49): the order of
# the sides' spans, a step's clock containing its own work and none of the other side's, and
# lower bounds that a sleep always meets (sleep(x) takes at least x of wall time and no CPU).


def test_the_sides_take_turns_and_time_only_their_own_steps(tmp_path):
    rec = _run_pair(tmp_path)
    spans = sorted((t0, t1, side) for side in ("a", "b") for t0, t1 in rec[side]["windows"])
    assert [s for _, _, s in spans] == ["a", "b"] * STEPS  # a moves first, then strictly in turns
    # one side's work ends before the other side's next step starts: never both at once
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), spans
    for side, other in (("a", "b"), ("b", "a")):
        steps, mine, theirs = _steps(rec[side]), rec[side]["windows"], rec[other]["windows"]
        assert len(steps) == STEPS and rec[side]["slowed_s"] == [0.0] * STEPS
        for (t0, t1), (w0, w1) in zip(steps, mine, strict=True):
            assert t0 <= w0 and w1 <= t1, (side, (t0, t1), (w0, w1))  # the step's clock holds its work ...
            assert not any(_overlaps((t0, t1), w) for w in theirs), (side, (t0, t1))  # ... and not the other's
        assert all(c < WORK_S for c in rec[side]["cpu_s"]), rec[side]["cpu_s"]  # the step's sleep costs no CPU


def test_a_slowdown_lands_in_the_slowed_sides_steps(tmp_path):
    """slow=0.5: side a adds half its step's own time as a sleep inside its clock; b adds none and
    its steps never overlap a's (slowdown included), so b's clock cannot see it."""
    rec = _run_pair(tmp_path, slow_a=0.5)
    a, b = rec["a"], rec["b"]
    assert b["slowed_s"] == [0.0] * STEPS and a["slow"] == 0.5
    for wall, cpu, slowed in zip(a["wall_s"], a["cpu_s"], a["slowed_s"], strict=True):
        assert slowed >= 0.5 * WORK_S  # half of a step that slept WORK_S at least
        assert wall >= WORK_S + slowed  # both sleeps inside the step's clock ...
        assert wall - cpu >= WORK_S + slowed  # ... as time without CPU (a sleep, not a spin)
        assert wall >= (1 + 0.5) * (slowed / 0.5)  # the slowdown is half the step's time before it
    for step in _steps(b):
        assert not any(_overlaps(step, s) for s in _steps(a)), step


def test_the_interval_of_ratios():
    sys.path.insert(0, str(BENCH))
    from _turns import interval

    same = interval([1.0, 1.0, 1.0], log=True)
    assert same["value"] == pytest.approx(1.0) and same["low"] == pytest.approx(1.0)
    r = interval([1.02, 1.04, 1.03, 1.03], log=True)
    assert r["low"] < 1.03 < r["high"] and r["low"] > 1.0 and r["value"] == pytest.approx(1.03, abs=1e-3)
    d = interval([-1.0, 1.0], log=False)
    assert d["value"] == 0 and d["low"] == pytest.approx(-12.706) and d["high"] == pytest.approx(12.706)
