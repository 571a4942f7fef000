"""A run's evaluation results, read back: summary.json's `eval` list and `<run>/eval/step-*.json`.

The report's table and plot and a sweep's `eval/<task>/<metric>` objective read them here, so what
"the run's score" means is said once: the newest evaluation (highest step) that scored the metric.
A result is {"step", "tasks": {task: {"metrics", "stderr", "version", "n_shot", "samples"}}, "seconds"},
or {"step", "error"} for an evaluation that failed. Standard library only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loom.rundir.paths import RunDir
from loom.schema import eval_objective


def _order(result: dict[str, Any]) -> float:
    """A result's place by step (a step-less one, e.g. `loom eval` of final/, last)."""
    step = result.get("step")
    return float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else math.inf


def eval_results(run_dir: Path | None, summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every evaluation of the run in step order: summary.json's `eval` list, with each step's
    `eval/step-N.json` file in its place (a later `loom eval` of that step rewrites the file)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in (summary or {}).get("eval") or []:
        if isinstance(r, dict):
            by_step[r.get("step")] = r
    for path in RunDir(run_dir).eval_results() if run_dir is not None else []:
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict):
            by_step[r.get("step")] = r
    return sorted(by_step.values(), key=_order)


def score(result: dict[str, Any], task: str, metric: str) -> float | None:
    """One result's finite value of `task`'s `metric` (None: not scored, or it failed)."""
    v = (((result.get("tasks") or {}).get(task) or {}).get("metrics") or {}).get(metric)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def eval_score(results: list[dict[str, Any]], task: str, metric: str) -> float | None:
    """The newest evaluation's score of `task`/`metric` (None: no evaluation scored it)."""
    for r in reversed(results):
        v = score(r, task, metric)
        if v is not None:
            return v
    return None


def objective_of(summary: dict[str, Any], name: str, run_dir: Path | None = None) -> float | None:
    """A trial's objective value: a dotted summary.json metric (`validation.loss`) or an evaluation
    score (`eval/<task>/<metric>`, the newest one; the run dir's eval/ files too when given)."""
    pair = eval_objective(name)
    if pair is not None:
        return eval_score(eval_results(run_dir, summary), *pair)
    node: Any = summary
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None
