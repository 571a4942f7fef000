"""The run's world history: one entry per attempt (a launch, or a torchrun restart within one),
written by global rank 0 as the attempt starts, so an attempt killed before it wrote a summary
is still in it. summary.json's `world_history` is this list.

Entry: {start_step, world_size, num_nodes, reason}; reason is `start` (the run's first attempt),
`world change` (another world size than the attempt before) or `restart` (the same world again,
after a failure, a preemption or a raised max_steps). Rank 0 adds the attempt's span at every
log step and at its end (`update_attempt`: end_step, samples, train_s, steady window, compile,
first step, validation and checkpoint seconds, status, launch time), so an attempt killed
without a summary still counts in the run's totals (`run_totals`) up to its last log step; the
next attempt marks such an attempt, left `running`, as `interrupted`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.rundir.paths import RunDir

REASONS = ("start", "restart", "world change")


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(RunDir(run_dir).world_history.read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def record_attempt(run_dir: Path, start_step: int, world_size: int, num_nodes: int) -> list[dict[str, Any]]:
    """Append this attempt's entry (rank 0 only) and return the whole history."""
    history = read_history(run_dir)
    if history and history[-1].get("status") == "running":  # it ended without saying how (killed)
        history[-1]["status"] = "interrupted"
    if not history:
        reason = "start"
    elif int(history[-1].get("world_size") or 0) != world_size:
        reason = "world change"
    else:
        reason = "restart"
    history.append({"start_step": int(start_step), "world_size": int(world_size), "num_nodes": int(num_nodes),
                    "reason": reason})
    atomic_write_text(RunDir(run_dir).world_history, json.dumps(history, indent=1) + "\n")
    return history


def world_changes(run_dir: Path) -> list[tuple[int, int, int]]:
    """(step, world before, world after) at each world change (`loom report` draws them)."""
    history = read_history(run_dir)
    return [(int(b["start_step"]), int(a["world_size"]), int(b["world_size"]))
            for a, b in zip(history, history[1:], strict=False) if b.get("reason") == "world change"]


def update_attempt(run_dir: Path, span: dict[str, Any]) -> None:
    """Merge `span` into the last (this) attempt's entry (rank 0 only)."""
    history = read_history(run_dir)
    if not history:
        return
    history[-1].update(span, updated_at=round(time.time(), 3))
    atomic_write_text(RunDir(run_dir).world_history, json.dumps(history, indent=1) + "\n")


TIME_PARTS = ("compile_s", "first_step_s", "validation_s", "checkpoint_s", "eval_s", "train_s")


def run_totals(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole run's totals over every attempt that recorded a span: steps trained (a restart
    trains again from its checkpoint), samples, tokens, each part of the time, and the steady
    window's samples and seconds. Wall time adds up each launch's, from its start to the last
    update of any of its attempts (torchrun's restarts share their launch)."""
    spans = [a for a in history if "end_step" in a]
    total: dict[str, Any] = {
        "steps": sum(int(a["end_step"]) - int(a.get("start_step", 0)) for a in spans),
        "samples": sum(int(a.get("samples", 0)) for a in spans),
        "tokens": sum(int(a.get("samples", 0)) * int(a.get("items_per_sample", 1)) for a in spans),
        "steady_samples": sum(int(a.get("steady_samples", 0)) for a in spans),
        "steady_tokens": sum(int(a.get("steady_samples", 0)) * int(a.get("items_per_sample", 1)) for a in spans),
        "steady_train_s": sum(float(a.get("steady_train_s") or 0.0) for a in spans),
        # targets trained (labels not ignored), where the batches say: None when no attempt counted them
        "trained_tokens": (sum(int(a["trained_tokens"]) for a in spans if a.get("trained_tokens") is not None)
                           if any(a.get("trained_tokens") is not None for a in spans) else None),
    }
    for part in TIME_PARTS:
        total[part] = round(sum(float(a.get(part) or 0.0) for a in spans), 4)
    launches: dict[float, float] = {}
    for a in spans:
        if a.get("launch_time") is not None and a.get("updated_at") is not None:
            start = float(a["launch_time"])
            launches[start] = max(launches.get(start, start), float(a["updated_at"]))
    total["wall_s"] = round(sum(end - start for start, end in launches.items()), 3)
    return total
