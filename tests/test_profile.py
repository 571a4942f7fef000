"""trainer.profile: torch.profiler traces of a window of steps on every rank, rank 0's summary in
`loom report`, and the refusal of a window outside the run.

No launch of its own: the profiled run is tests/test_tracking.py's shared ddp_run (steps 3-4,
memory=true); that profiling leaves the losses and weights unchanged is tests/test_data.py's
killed-and-resumed digits run, profiled, which must equal its unprofiled reference bit for bit."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import launching_fixture, refused, run_loom
from test_tracking import DDP_ARGS, PROFILED, SENTINELS, STEPS


@launching_fixture(scope="module")
def profiled(shared):
    r = shared.get(*DDP_ARGS, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    return r


def _trace(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_every_rank_writes_a_trace_of_exactly_the_window(profiled):
    """rank-N.pt.trace.json.gz per rank, plain Chrome-trace JSON once gunzipped, holding the
    ProfilerStep#3 and #4 ranges (Loom's step numbers) and no other step; the phases are marked."""
    traces = sorted((profiled.run_dir / "profile").glob("rank-*.pt.trace.json.gz"))
    assert [p.name for p in traces] == ["rank-0.pt.trace.json.gz", "rank-1.pt.trace.json.gz"]
    for path in traces:
        events = _trace(path)
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {f"ProfilerStep#{s}" for s in range(*PROFILED)}, (path, steps)
        names = {e.get("name") for e in events}
        assert {"loom:forward", "loom:backward", "loom:optimizer", "aten::mm"} <= names
        assert any(e.get("name") == "[memory]" for e in events)  # memory=true: allocations recorded
    assert "profiling steps 3-4" in (profiled.run_dir / "logs" / "rank-1.log").read_text()


def test_rank0_summary_splits_the_step_time_and_the_report_shows_it(profiled):
    """profile/summary.json: the window's steps, compute + communication + data wait = the step
    time (DDP all-reduces every step: communication > 0), top operators by self time with both
    matmuls among them, each op's calls those of rank 0's trace, the CPU allocator's peak per
    phase; `loom report` renders exactly these figures in report.md."""
    p = json.loads((profiled.run_dir / "profile" / "summary.json").read_text())
    assert p["window"] == list(PROFILED) and p["steps"] == list(range(*PROFILED))
    t, share = p["time_ms"], p["share"]
    assert t["step"] > 0 and t["communication"] > 0 and t["compute"] > 0
    assert t["compute"] + t["communication"] + t["data_wait"] == pytest.approx(t["step"], abs=0.01)
    assert sum(share.values()) == pytest.approx(1.0, abs=1e-3)
    assert p["self_time"] == "cpu" and p["trace"] == "rank-0.pt.trace.json.gz"
    ops = p["top_ops"]
    assert len(ops) == 15 and all(a["self_ms"] >= b["self_ms"] for a, b in zip(ops, ops[1:], strict=False))
    # the forward's biased Linears run aten::addmm, their backward and the head aten::mm
    assert {"aten::mm", "aten::addmm"} <= {o["name"] for o in ops}, ops
    trace = _trace(profiled.run_dir / "profile" / "rank-0.pt.trace.json.gz")
    for o in ops:  # the summary's rule on the trace: every host range of the name, on every thread
        ranges = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
                  and e.get("name") == o["name"]]
        assert o["calls"] == len(ranges), (o, len(ranges))
        assert 0 < o["self_ms"] <= sum(e["dur"] for e in ranges) / 1000 + 1e-3, o  # self time: within the ranges
        assert o["share"] == pytest.approx(o["self_ms"] / t["step"], abs=1e-4)
    peaks = p["memory_peak_bytes_per_phase"]
    assert set(peaks) == {"forward", "backward", "optimizer"} and all(set(v) == {"cpu"} for v in peaks.values())
    assert peaks["forward"]["cpu"] > 0
    assert p["memory_snapshot"] is None  # a CUDA snapshot on a GPU only

    r = run_loom("report", str(profiled.run_dir), root=profiled.run_dir.parents[1])
    assert r.rc == 0, r.out + r.err
    md = (profiled.run_dir / "report.md").read_text()
    expected = [
        "## Profile", "",
        f"Rank 0, steps 3-4 ({t['step']:,.1f} ms): traces for every rank in `profile/` (open them in "
        "https://ui.perfetto.dev or TensorBoard's profiler plugin).", "",
        "| time in | ms | share |", "|---|---|---|",
        *(f"| {k.replace('_', ' ')} | {t[k]:,.1f} | {100 * share[k]:.1f}% |"
          for k in ("compute", "communication", "data_wait")), "",
        "Top operators by cpu self time:", "",
        "| operator | self ms | calls | share of step time |", "|---|---|---|---|",
        *(f"| {o['name']} | {o['self_ms']:,.2f} | {o['calls']} | {100 * o['share']:.1f}% |" for o in ops), "",
        "Allocator peak per phase (above the window's start):", "",
        "| phase | cpu |", "|---|---|",
        *(f"| {ph} | {peaks[ph]['cpu'] / 2**20:,.1f} MiB |" for ph in ("forward", "backward", "optimizer")), ""]
    assert "\n".join(expected) in md, md


def test_summary_and_metrics_are_those_of_a_full_run(profiled):
    s = json.loads((profiled.run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["global_step"] == STEPS


@pytest.mark.parametrize("window", ["[0,2]", "[5,5]", f"[3,{STEPS + 2}]", "[1,2,3]", "[2]"])
def test_a_window_outside_the_run_is_refused_naming_the_key(tmp_path, window):
    err = refused(tmp_path, "hardware=cpu", f"trainer.max_steps={STEPS}", f"trainer.profile.steps={window}")
    assert "trainer.profile.steps=" in err and f"<= {STEPS + 1}" in err


def test_top_ops_are_the_traces_ranges_with_self_time_per_thread():
    """Self time is a range's duration less its direct children's on its own thread; a range
    nested in one of the same name counts as a call of its own (torch's key_averages merges it);
    another thread's ranges are its own; a GPU trace ranks its kernels by device time."""
    from loom.worker.profile_summary import top_ops

    def x(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    events = [x("ProfilerStep#3", 0, 100, cat="user_annotation"),
              x("aten::add_", 10, 30), x("aten::add_", 12, 20),  # one call inside another of its name
              x("aten::copy_", 15, 5),                            # ... inside that
              x("aten::mm", 50, 40), x("aten::mm", 55, 100, tid=2),  # two threads
              x("gloo:all_reduce", 60, 10, tid=3, cat="user_annotation"),
              {"ph": "i", "name": "aten::mm", "ts": 1}]         # not a range
    ops, device = top_ops(events, step_ms=0.1)
    assert not device
    assert ops == [{"name": "aten::mm", "self_ms": 0.14, "calls": 2, "share": 1.4},
                   {"name": "aten::add_", "self_ms": 0.025, "calls": 2, "share": 0.25},  # (30-20) + (20-5)
                   {"name": "gloo:all_reduce", "self_ms": 0.01, "calls": 1, "share": 0.1},
                   {"name": "aten::copy_", "self_ms": 0.005, "calls": 1, "share": 0.05}]
    kernels = [x("sm90_gemm", 0, 30, cat="kernel"), x("sm90_gemm", 40, 20, cat="kernel"),
               x("ncclAllReduce", 10, 50, cat="kernel")]
    ops, device = top_ops(events + kernels, step_ms=0.1)
    assert device and [(o["name"], o["self_ms"], o["calls"]) for o in ops] == [
        ("sm90_gemm", 0.05, 2), ("ncclAllReduce", 0.05, 1)]


def test_time_split_merges_overlapping_ranges_and_keeps_them_inside_the_steps():
    """Nested collectives count once, and time outside the profiled steps not at all."""
    from loom.worker.profile_summary import time_split

    x = "X"
    events = [{"ph": x, "name": "ProfilerStep#3", "ts": 0, "dur": 100, "cat": "user_annotation"},
              {"ph": x, "name": "ProfilerStep#4", "ts": 100, "dur": 100, "cat": "user_annotation"},
              {"ph": x, "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "ts": 100, "dur": 10,
               "cat": "user_annotation"},
              {"ph": x, "name": "c10d::allreduce_", "ts": 50, "dur": 20, "cat": "cpu_op"},
              {"ph": x, "name": "record_param_comms", "ts": 55, "dur": 10, "cat": "cpu_op"},  # inside the one above
              {"ph": x, "name": "gloo:all_reduce", "ts": 190, "dur": 30, "cat": "cpu_op"}]  # 10 inside the steps
    out = time_split(events)
    assert out["steps"] == [3, 4]
    assert out["time_ms"] == {"step": 0.2, "communication": 0.03, "data_wait": 0.01, "compute": 0.16}
