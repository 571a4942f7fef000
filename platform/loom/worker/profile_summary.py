"""Rank 0's reading of its profile window, for `loom report`, from its trace file: the top
operators by self time (on a GPU the kernels by device time) and where the steps' time went (communication, data wait, compute), plus the allocator's peak
per phase. Written to `<run>/profile/summary.json` so the report needs no torch.

Time shares are of the profiled steps' wall time (`ProfilerStep#N` ranges): data wait is the
DataLoader's `__next__` ranges torch annotates; communication is the union of collective
operators (CPU side; on a GPU the NCCL kernels, which may overlap compute); compute is the rest.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text

TOP_OPS = 15
COLLECTIVE = re.compile(r"c10d::|nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|"
                        r"record_param_comms|barrier", re.IGNORECASE)
PHASES = ("forward", "backward", "optimizer")
DEVICE_TYPES = {0: "cpu", 1: "cuda"}


OP_CATEGORIES = ("cpu_op", "user_annotation")  # host-side ranges: operators, record_function annotations
NOT_OPS = ("ProfilerStep#", "loom:")            # the window's own marks, not work


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each host range's self time (µs): its duration less its direct children's on the same
    thread (torch's definition); ranges that start in a parent and end past it count as its children."""
    out: list[tuple[dict, float]] = []
    by_thread: dict[tuple[Any, Any], list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for spans in by_thread.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, children's µs]
        for e in spans:
            while stack and stack[-1][1] <= e["ts"]:
                done = stack.pop()
                out.append((done[0], done[0]["dur"] - done[2]))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        out.extend((done[0], done[0]["dur"] - done[2]) for done in reversed(stack))
    return out


def top_ops(events: list[dict], step_ms: float, n: int = TOP_OPS) -> tuple[list[dict], bool]:
    """(the n largest entries by self time, each with its calls and its share of the profiled
    steps' time; whether that is device time). Read from the trace itself, every thread: each
    figure is the trace's, so `calls` is the number of the name's ranges a user finds in Perfetto.
    On a GPU the entries are the kernels by device time; on a CPU the operators and annotations
    by self time. Written by hand because torch's `key_averages()` merges a range into a parent of
    the same name with a single child (EventList._remove_dup_nodes): its counts are not the trace's."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    if kernels:
        timed = [(e, float(e["dur"])) for e in kernels]
    else:
        host = [e for e in events if e.get("ph") == "X" and e.get("cat") in OP_CATEGORIES and "dur" in e]
        timed = [(e, t) for e, t in _self_times(host) if not e["name"].startswith(NOT_OPS)]
    totals: dict[str, list[float]] = {}
    for e, us in timed:
        entry = totals.setdefault(e["name"], [0.0, 0])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:n]
    return [{"name": name, "self_ms": round(us / 1000, 3), "calls": int(calls),
             "share": round(us / 1000 / step_ms, 4) if step_ms else None}
            for name, (us, calls) in ranked], bool(kernels)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(spans: list[tuple[float, float]], within: list[tuple[float, float]]) -> float:
    """Total length of `spans` (merged) inside `within` (merged)."""
    total, spans, within = 0.0, _union(spans), _union(within)
    for a, b in spans:
        for c, d in within:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def time_split(events: list[dict]) -> dict[str, Any]:
    """Step time (ms) and its split into communication, data wait and compute."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith("ProfilerStep#")]
    numbers = sorted({int(e["name"].split("#")[1]) for e in spans if e["name"].startswith("ProfilerStep#")})
    gpu = any(e.get("cat") == "kernel" for e in spans)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans if COLLECTIVE.search(e["name"])
            and (e.get("cat") == "kernel" if gpu else e.get("cat") in ("cpu_op", "user_annotation"))]
    data = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith("enumerate(DataLoader)")]
    step_us = _overlap(steps, steps)
    comm_us, data_us = _overlap(comm, steps), _overlap(data, steps)
    compute_us = max(0.0, step_us - comm_us - data_us)
    ms = {"step": step_us, "communication": comm_us, "data_wait": data_us, "compute": compute_us}
    return {"steps": numbers, "time_ms": {k: round(v / 1000, 3) for k, v in ms.items()},
            "share": {k: round(v / step_us, 4) if step_us else None for k, v in ms.items() if k != "step"}}


def phase_peaks(events: list[dict]) -> dict[str, dict[str, int]]:
    """The allocator's peak (bytes allocated above the window's start, per device type) inside
    each phase's `loom:<phase>` ranges, from the profiler's memory events (profile_memory)."""
    ranges = {p: [(e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("ph") == "X" and e.get("name") == f"loom:{p}"] for p in PHASES}
    peaks: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("name") != "[memory]":
            continue
        args = e.get("args", {})
        device = DEVICE_TYPES.get(args.get("Device Type"), str(args.get("Device Type")))
        for phase, spans in ranges.items():
            if any(a <= e["ts"] <= b for a, b in spans):
                cur = peaks.setdefault(phase, {})
                cur[device] = max(cur.get(device, 0), int(args.get("Total Allocated", 0)))
    return peaks


def write_summary(trace: Path, out: Path, window: tuple[int, int], snapshot: Path | None) -> None:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    split = time_split(events)
    ops, device = top_ops(events, split["time_ms"]["step"])
    summary = {"window": list(window), **split, "top_ops": ops,
               "self_time": "device" if device else "cpu", "trace": trace.name,
               "memory_peak_bytes_per_phase": phase_peaks(events) or None,
               "memory_snapshot": snapshot.name if snapshot else None}
    if snapshot is not None:
        import torch

        summary["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    atomic_write_text(out, json.dumps(summary, indent=2) + "\n")
