"""Straggler detection on rank 0, from the per-rank vector the recorder already all-gathers at
every log step (no collective of its own).

In a synchronous run every rank's wall step time is the same: the fast ranks wait for the slow
one inside the collectives. What differs is each rank's own work before its first collective:
its data wait (the loader) and its forward (`compute`). A rank whose own time exceeds the
lower median rank's by more than `tracking.straggler_threshold` of the median step time, at
`tracking.straggler_window` consecutive log steps, is a straggler: named once on the console
and in summary.json `stragglers` [{rank, host, slowdown, cause, first_step}], where `slowdown`
is that excess as a fraction of the step and `cause` is `data` or `compute`, whichever grew more.
Every log step's per-rank times go to `<run>/ranks.jsonl` for `loom report`'s heatmap.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from loom.rundir.paths import RunDir

log = logging.getLogger("loom")


class StragglerWatch:
    def __init__(self, run_dir: Path | None, threshold: float, window: int, hosts: list[str] | None = None) -> None:
        self.path = RunDir(run_dir).ranks if run_dir is not None else None
        self.threshold, self.window = threshold, window
        self.hosts = hosts or []
        self.streak: dict[int, list[int]] = {}   # rank -> the log steps of its current streak
        self.found: list[dict[str, Any]] = []     # named stragglers, in the order found

    def host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "?"

    def update(self, step: int, step_ms: list[float], data_ms: list[float], compute_ms: list[float]) -> None:
        """One log step's per-rank figures (rank order): record them, extend or break streaks."""
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "step_ms": _r(step_ms), "data_wait_ms": _r(data_ms),
                                    "compute_ms": _r(compute_ms)}) + "\n")
        if len(step_ms) < 2:
            return
        own = [d + c for d, c in zip(data_ms, compute_ms, strict=True)]
        ref = statistics.median_low(own)
        ref_rank = own.index(ref)
        step_time = statistics.median(step_ms) or 1e-9
        named = {s["rank"] for s in self.found}
        for rank, mine in enumerate(own):
            slowdown = (mine - ref) / step_time
            if slowdown <= self.threshold:
                self.streak.pop(rank, None)
                continue
            steps = self.streak.setdefault(rank, [])
            steps.append(step)
            if len(steps) >= self.window and rank not in named:
                data_excess = data_ms[rank] - data_ms[ref_rank]
                compute_excess = compute_ms[rank] - compute_ms[ref_rank]
                self._name(rank, slowdown, "data" if data_excess > compute_excess else "compute", steps[0])

    def _name(self, rank: int, slowdown: float, cause: str, first_step: int) -> None:
        """The console line says the summary's (rounded) slowdown, so the two never disagree."""
        entry = {"rank": rank, "host": self.host(rank), "slowdown": round(slowdown, 3), "cause": cause,
                 "first_step": first_step}
        self.found.append(entry)
        what = "its data loader (data wait)" if cause == "data" else "its own compute (forward)"
        log.warning(f"Straggler: rank {rank} on {entry['host']} spends {100 * entry['slowdown']:.0f}% of a step more than "
                    f"the median rank in {what} since step {first_step}; every rank waits for it "
                    f"(summary.json stragglers, `loom report` heatmap)")


def _r(values: list[float]) -> list[float]:
    return [round(float(v), 3) for v in values]


def read_ranks(run_dir: Path) -> list[dict[str, Any]]:
    """The per-rank rows of `<run>/ranks.jsonl`, one per log step (a step logged again after a
    resume keeps its last record), in step order."""
    path = RunDir(run_dir).ranks
    if not path.is_file():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


def gather_hosts(world_size: int) -> list[str]:
    """Every rank's host name, by rank (one all_gather_object at train start, on every rank);
    ["<this host>"] alone for one process or when the gather fails."""
    import socket

    me = socket.gethostname()
    import torch.distributed as dist

    if world_size <= 1 or not dist.is_initialized():
        return [me]
    try:
        hosts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, me)
        return [str(h) for h in hosts]
    except Exception as e:  # naming hosts is a convenience: never fail a run for it
        log.debug(f"host names not gathered ({type(e).__name__}: {e})")
        return [me]
