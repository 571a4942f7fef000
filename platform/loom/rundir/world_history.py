"""The run's world history: one entry per attempt (a launch, or a torchrun restart within one),
written by global rank 0 as the attempt starts, so an attempt killed before it wrote a summary
is still in it. summary.json's `world_history` is this list.

Entry: {start_step, world_size, num_nodes, reason}; reason is `start` (the run's first attempt),
`world change` (another world size than the attempt before) or `restart` (the same world again,
after a failure, a preemption or a raised max_steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text

FILE = "world_history.json"
REASONS = ("start", "restart", "world change")


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def record_attempt(run_dir: Path, start_step: int, world_size: int, num_nodes: int) -> list[dict[str, Any]]:
    """Append this attempt's entry (rank 0 only) and return the whole history."""
    history = read_history(run_dir)
    if not history:
        reason = "start"
    elif int(history[-1].get("world_size") or 0) != world_size:
        reason = "world change"
    else:
        reason = "restart"
    history.append({"start_step": int(start_step), "world_size": int(world_size), "num_nodes": int(num_nodes),
                    "reason": reason})
    atomic_write_text(Path(run_dir) / FILE, json.dumps(history, indent=1) + "\n")
    return history


def world_changes(run_dir: Path) -> list[tuple[int, int, int]]:
    """(step, world before, world after) at each world change (`loom report` draws them)."""
    history = read_history(run_dir)
    return [(int(b["start_step"]), int(a["world_size"]), int(b["world_size"]))
            for a, b in zip(history, history[1:], strict=False) if b.get("reason") == "world change"]
