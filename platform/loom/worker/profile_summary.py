"""Rank 0's reading of its profile window, for `loom report`: the top operators by self time
and where the steps' time went (communication, data wait, compute), plus the allocator's peak
per phase. Written to `<run>/profile/summary.json` so the report needs no torch.

Time shares are of the profiled steps' wall time (`ProfilerStep#N` ranges): data wait is the
DataLoader's `__next__` ranges torch annotates; communication is the union of collective
operators (CPU side; on a GPU the NCCL kernels, which may overlap compute); compute is the rest.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text

TOP_OPS = 15
COLLECTIVE = re.compile(r"c10d::|nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|"
                        r"record_param_comms|barrier", re.IGNORECASE)
PHASES = ("forward", "backward", "optimizer")
DEVICE_TYPES = {0: "cpu", 1: "cuda"}


def top_ops(averages: Iterable[Any], step_ms: float, n: int = TOP_OPS) -> tuple[list[dict], bool]:
    """(the n operators with the most self time, each with its share of the profiled steps'
    time; whether that is device time)."""
    rows = [a for a in averages if not a.key.startswith(("ProfilerStep#", "loom:"))]
    device = any(getattr(a, "self_device_time_total", 0) > 0 for a in rows)
    attr = "self_device_time_total" if device else "self_cpu_time_total"
    rows.sort(key=lambda a: getattr(a, attr), reverse=True)
    return [{"name": a.key, "self_ms": round(getattr(a, attr) / 1000, 3), "calls": int(a.count),
             "share": round(getattr(a, attr) / 1000 / step_ms, 4) if step_ms else None} for a in rows[:n]], device


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


def write_summary(prof: Any, trace: Path, out: Path, window: tuple[int, int], snapshot: Path | None) -> None:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    split = time_split(events)
    ops, device = top_ops(prof.key_averages(), split["time_ms"]["step"])
    summary = {"window": list(window), **split, "top_ops": ops,
               "self_time": "device" if device else "cpu", "trace": trace.name,
               "memory_peak_bytes_per_phase": phase_peaks(events) or None,
               "memory_snapshot": snapshot.name if snapshot else None}
    if snapshot is not None:
        import torch

        summary["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    atomic_write_text(out, json.dumps(summary, indent=2) + "\n")
