"""Worker failures: one record per failing rank, `<run>/logs/error-rank-N.json`, and the one
paragraph the launcher prints from them (torch-free: the launcher and `loom.finish` read them).

A rank that fails writes its record and the full traceback to its own `logs/rank-N.log`, then
exits without printing the traceback (loom.worker.failure classifies it). The launcher merges
the root failure (a rank's own error before a peer's collateral one, then the earliest) into
summary.json `error` {type, message, rank, step, log, where} and prints it as one paragraph.
Records of earlier launches stay on disk; a launch reads only those written since it started
(`since`: the launcher's clock; ranks on other nodes may be slightly off, hence CLOCK_SKEW_S).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.rundir.hangs import merge_hangs
from loom.rundir.paths import RunDir

CLOCK_SKEW_S = 2.0
# The contract's fields of summary.json `error` (plus `where`: file:line of the raising frame).
ERROR_FIELDS = ("type", "message", "rank", "step", "log", "where")


def failure_path(run_dir: Path, rank: int) -> Path:
    return RunDir(run_dir).failure(rank)


def write_failure(run_dir: Path, record: dict[str, Any]) -> Path:
    return atomic_write_text(failure_path(run_dir, int(record["rank"])), json.dumps(record, indent=2) + "\n")


def read_failures(run_dir: Path, since: float | None) -> list[dict[str, Any]]:
    """Every rank's failure record written since `since` (all of them when None); the ranks'
    `hang` records (loom.worker.hang) as one, whose message says where every rank stood."""
    out = []
    for path in RunDir(run_dir).failures():
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and (since is None or rec.get("time", 0) >= since - CLOCK_SKEW_S):
            out.append(rec)
    return merge_hangs(out)


def root_failure(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure that caused the others: a rank's own (not collateral); a deterministic one
    (every rank raises the same: the lowest rank's), else the earliest."""
    if not records:
        return None
    return min(records, key=lambda r: (bool(r.get("collateral")), not r.get("deterministic"),
                                       r.get("rank", 0) if r.get("deterministic") else r.get("time", 0)))


def summary_error(record: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if record is None else {k: record.get(k) for k in ERROR_FIELDS}


def failure_paragraph(record: dict[str, Any]) -> str:
    """What failed, where, and the log with the full traceback: one paragraph, no traceback."""
    if record.get("type") == "hang":
        return str(record.get("message"))
    step = record.get("step")
    when = "before the first training step" if record.get("before_first_step") else f"at step {step}"
    where = f" at {record['where']}" if record.get("where") else ""  # file:line, in function
    phase = f" while {record['phase']}" if record.get("phase") else ""
    retried = f" after {record['attempt']} restart(s)" if record.get("attempt") else ""
    text = (f"Training failed on rank {record.get('rank')} {when}{phase}{retried}: {record.get('type')}: "
            f"{record.get('message')} (raised{where}).")
    if record.get("deterministic"):
        text += (f" Not restarted: a {record.get('type')} is a configuration, code or data error that a restart "
                 "would only repeat; fix it and run the same command again.")
    return f"{text} Full traceback: {record.get('log')}"
