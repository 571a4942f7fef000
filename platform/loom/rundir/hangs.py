"""Hang records: where a rank's main thread stood when its watchdog fired (loom.worker.hang),
and the one paragraph the launcher makes of every rank's record (torch-free).

"Rank 1 is in training_step (model.py:88) at step 5, not in a collective; rank 0 waits in
backward (torch/autograd/graph.py:829: DDP all-reduces the gradients there)": the ranks that are
not waiting on the others are named first, as the likely cause.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import FrameType
from typing import Any

from loom.rundir.paths import RunDir

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "gather", "scatter", "reduce", "wait", "wait_tensor"}
_LIBRARY = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_LOOM = str(Path(__file__).resolve().parents[1])


def _own_code(filename: str) -> bool:
    return filename.startswith(_LOOM) or not (filename.startswith("<") or filename.startswith(_LIBRARY))


def _short(filename: str) -> str:
    """A library's file by its import path (torch/autograd/graph.py), anything else as is."""
    for root in _LIBRARY:
        if filename.startswith(root + "/"):
            return filename[len(root) + 1:]
    return filename


def frame_label(frame: FrameType | None) -> tuple[str, str]:
    """(what the thread is doing, file:line): a torch.distributed collective, autograd's
    backward (where DDP and FSDP wait for their gradient collectives), else the innermost frame
    of the user's or Loom's code."""
    stack: list[tuple[str, int, str]] = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    if not stack:
        return "is nowhere Python can see", "?"
    for filename, line, name in stack:  # innermost first
        if "torch/distributed" in filename and name in COLLECTIVES:
            return f"waits in {name}", f"{_short(filename)}:{line}"
    for filename, line, _name in stack:
        if "torch/autograd" in filename:
            return "waits in backward (gradient collectives run there)", f"{_short(filename)}:{line}"
    for filename, line, name in stack:
        if _own_code(filename):
            return f"is in {name}", f"{filename}:{line}"
    filename, line, name = stack[0]
    return f"is in {name}", f"{_short(filename)}:{line}"


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 4] -> "ranks 0-2, 4"; [3] -> "rank 3"."""
    ranks, spans = sorted(ranks), []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(spans)}"


def hang_paragraph(hangs: list[dict[str, Any]]) -> str:
    """One paragraph from every rank's hang record: who stands where, the not-waiting first."""
    groups: dict[tuple[str, str, int], list[int]] = {}
    for h in hangs:
        groups.setdefault((h.get("label", "?"), h.get("where", "?"), h.get("step", 0)), []).append(int(h["rank"]))
    parts = []
    for (label, where, step), ranks in sorted(groups.items(), key=lambda g: (g[0][0].startswith("waits"), g[1])):
        tail = "" if label.startswith("waits") else ", not in a collective"
        verb = label if len(ranks) == 1 else label.replace("is in", "are in").replace("waits", "wait")
        parts.append(f"{_ranks_text(ranks)} {verb} at step {step} ({where}){tail}")
    first = min(hangs, key=lambda h: h.get("time", 0))
    logs = str(RunDir(Path(first["log"]).parent.parent).hang("N"))  # the log is <run>/logs/rank-N.log
    text = "; ".join(parts)
    return (f"Training hung: no step progress for {first.get('timeout_s', 0):g} s "
            f"(hardware.hang_timeout_s). {text[0].upper()}{text[1:]}. Every thread's stack of each rank: {logs}.")


def merge_hangs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' `hang` records as one (its message the paragraph, its rank the first not
    waiting), the other records as they are."""
    hangs = [r for r in records if r.get("type") == "hang"]
    if not hangs:
        return records
    culprit = min(hangs, key=lambda h: (str(h.get("label", "")).startswith("waits"), h.get("rank", 0)))
    merged = {**culprit, "message": hang_paragraph(hangs), "time": min(h.get("time", 0) for h in hangs),
              "ranks": sorted(int(h["rank"]) for h in hangs)}
    return [merged, *(r for r in records if r.get("type") != "hang")]
