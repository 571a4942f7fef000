"""report.md's evaluation section: every evaluation's scores per step, task and metric (with lm-eval's
stderr, the few-shot count and the task version), a failed evaluation as a row that says so, and
`plots/eval.png` (loom.tracking.plots) beside the loss. Reads rundir.eval_results only: no lm-eval."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from loom.rundir.eval_results import eval_results

SHOWN = 3   # scores in the summary's one line (report.md's table has them all)
HEADER = ["step", "task", "metric", "value", "stderr", "n-shot", "version", "documents", "source"]


def _step(r: dict[str, Any]) -> str:
    step = r.get("step")
    return "final" if step is None else str(step)


def _value(v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"  # a word perplexity of an untrained model: 6.261e+09
    return "n/a"


def eval_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per (evaluation, task, metric), in step order; a failed evaluation is one row with its error."""
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([_step(r), "(all)", "evaluation failed", str(r["error"]).splitlines()[0] if r["error"] else "",
                         "", "", "", "", str(r.get("source", ""))])
            continue
        for task, t in sorted((r.get("tasks") or {}).items()):
            stderr = t.get("stderr") or {}
            for metric, v in sorted((t.get("metrics") or {}).items()):
                rows.append([_step(r), task, metric, _value(v),
                             _value(stderr[metric]) if metric in stderr else "",
                             str(t.get("n_shot", "")), str(t.get("version", "")), str(t.get("samples", "")),
                             str(r.get("source", ""))])
    return rows


def latest_text(results: list[dict[str, Any]]) -> str | None:
    """The newest successful evaluation's scores in one line, for the summary table (None: none)."""
    done = [r for r in results if not r.get("error") and r.get("tasks")]
    failed = sum(1 for r in results if r.get("error"))
    if not done:
        return f"{failed} evaluation(s) failed, none scored" if failed else None
    r = done[-1]
    scores = [f"{task} {metric} {_value(v)}" for task, t in sorted(r["tasks"].items())
              for metric, v in sorted((t.get("metrics") or {}).items())]
    more = f"; {failed} failed" if failed else ""
    shown = ", ".join(scores[:SHOWN]) + (f", +{len(scores) - SHOWN} more in report.md" if len(scores) > SHOWN else "")
    return f"{shown} (step {_step(r)}; {len(results)} evaluation(s){more})"


def eval_section(run_dir: Path, summary: dict[str, Any], table: Any) -> list[str]:
    """report.md's "Evaluation" lines ([] when the run has no evaluation); `table` formats markdown."""
    results = eval_results(run_dir, summary)
    if not results:
        return []
    lines = ["## Evaluation", "", table(HEADER, eval_rows(results)), ""]
    return lines
