"""A comparison of several runs (a sweep dir, runs/<experiment>/, or run dirs given one by one).

One row per run: status, and for a sweep (a dir with the manifest.json `loom train -m` writes)
one column per swept parameter, the final train and validation losses, the sweep's objective,
a ★ on the best trial and each trial's rank; then strategy, hardware, world size, throughput in
the task's unit (tokens/s, or samples/s for classifiers), MFU and peak memory. A sweep's rows are
titled by their swept values ("strategy=fsdp", not the run id), ↻ marking a resumed or restarted
trial. When every completed trial's objective is equal within its noise (`tie.py`: Loom's
strategies train the same losses), no trial is starred: the report says so and ranks them by
throughput, then peak memory, and `trials.png` draws both per trial (`sweep_plots.py`).

Scaling efficiency, only when the world sizes differ: a run's tokens/s (samples/s) per device /
the baseline's, where the baseline is a run at the smallest world size in the set: the one with
the same strategy if there is one, else the fastest per device at that size (1.0 is linear
scaling); `scaling.png` plots throughput against world size. A sweep also plots its objective
against each swept parameter (`objective_vs_<param>.png`; not for a tie: a flat row of dots).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.report.runs import Run, _md_table, _num, _pct, _write, error_text
from loom.report.sweep_plots import TrialBar, scaling_plot, trials_plot
from loom.report.tie import REL_TOL, Tie, tie_of
from loom.rundir.eval_results import objective_of
from loom.rundir.paths import SweepDir
from loom.schema import eval_objective


@dataclass
class Sweep:
    """What manifest.json says about the runs: the objective and each run's swept values."""

    objective: str = "final_loss"
    direction: str = "minimize"
    params: dict[Path, dict[str, Any]] = field(default_factory=dict)  # run dir -> {key: value}

    @property
    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.params.values():
            seen.update(dict.fromkeys(p))
        return list(seen)


def read_sweep(sweep_dir: Path | None) -> Sweep | None:
    """The sweep's manifest (None: not a sweep dir, or a manifest that cannot be read)."""
    path = SweepDir(sweep_dir).manifest if sweep_dir else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        trials = [t for t in data["trials"] if t.get("run_dir")]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out = Sweep(data.get("objective") or "final_loss", data.get("direction") or "minimize")
    for t in trials:
        params = t.get("params") or {}
        if not params:  # a manifest from before params were recorded: the overrides that differ
            params = _differing(trials, t)
        out.params[Path(t["run_dir"]).resolve()] = params
    return out


def _differing(trials: list[dict], t: dict) -> dict[str, Any]:
    split = [dict(o.partition("=")[::2] for o in x.get("overrides", [])) for x in trials]
    mine = dict(o.partition("=")[::2] for o in t.get("overrides", []))
    keys = {k for d in split for k in d if any(d2.get(k) != d.get(k) for d2 in split)}
    return {k: mine.get(k) for k in sorted(keys) if not k.startswith("run.")}


def _scored(runs: list[Run], sweep: Sweep) -> list[tuple[float, Run]]:
    """(objective value, run) of the completed runs that have a finite one."""
    scored = [(objective_of(r.summary, sweep.objective, r.path), r) for r in runs if r.summary.get("status") == "completed"]
    return [(v, r) for v, r in scored if v is not None and math.isfinite(v)]


def ranking(runs: list[Run], sweep: Sweep) -> tuple[list[Run], Tie | None]:
    """The completed runs with an objective value, best first, and the tie when they tie (then
    in the tie's order: throughput, then peak memory)."""
    scored = _scored(runs, sweep)
    tie = tie_of(scored, sweep.objective)
    if tie is not None:
        return tie.order, tie
    scored.sort(key=lambda vr: -vr[0] if sweep.direction == "maximize" else vr[0])
    return [r for _, r in scored], None


def best_run(runs: list[Run], sweep: Sweep) -> Run | None:
    """The completed run with the best objective (None: no completed run has a value, or they tie)."""
    order, tie = ranking(runs, sweep)
    return order[0] if order and tie is None else None


def title(r: Run, sweep: Sweep | None) -> str:
    """A trial by its swept values ("strategy=fsdp"; the run id when none are known), ↻ if resumed."""
    params = (sweep.params.get(r.path) if sweep is not None else None) or {}
    text = " ".join(f"{k}={v}" for k, v in params.items()) or r.path.name
    return f"{text} ↻" if resumed(r) else text


def resumed(r: Run) -> str | None:
    """How the run did not train in one go ("resumed from step 4", "restarted 1x"), or None."""
    s = r.summary
    if s.get("resumed_from_step") is not None:
        return f"resumed from step {s['resumed_from_step']}"
    return f"restarted {s['restarts']}x" if s.get("restarts") else None


def _value(v: float, objective: str) -> str:
    return f"{v:,.1f}" if objective.startswith("throughput.") and "mfu" not in objective else f"{v:.4f}"


def best_line(runs: list[Run], sweep: Sweep) -> str:
    order, tie = ranking(runs, sweep)
    if tie is not None:
        return tie_line(tie, sweep)
    if not order:
        return f"best trial: none (no completed trial has {sweep.objective})"
    best = order[0]
    value = objective_of(best.summary, sweep.objective, best.path)
    extreme = "highest" if sweep.direction == "maximize" else "lowest"
    return f"best trial: {title(best, sweep)} ({sweep.objective} {_value(value, sweep.objective)}, the {extreme}): " \
           f"{best.path}"


def tie_line(tie: Tie, sweep: Sweep) -> str:
    """No best trial: the objective's spread, the tolerance it is within and why, then the ranking."""
    why = (f"{tie.tolerance / tie.noise:g} x the trials' {tie.noise_is} {tie.noise:.2g}" if tie.by_noise
           else f"{REL_TOL:.1%} of the value: float summation order")
    ranked = ", ".join(f"{i}. {title(r, sweep)} ({_rate(r)}, {_mem(r)})" for i, r in enumerate(tie.order, 1))
    return (f"no best trial: all {len(tie.order)} completed trials tie on {tie.objective} (spread {tie.spread:.2g}, "
            f"within {tie.tolerance:.2g}: {why}); ranked by {tie.ranked_by}: {ranked}")


def _rate(r: Run) -> str:
    unit = "samples/s" if r.classifier else "tokens/s"
    return f"{r.rate:,.0f} {unit}" if r.rate is not None else f"{unit} unknown"


def _mem(r: Run) -> str:
    mem, kind = r.peak_memory()
    return f"{mem:.2f} GB {kind}" if mem is not None else "peak memory unknown"


def _order(v: Any) -> tuple[int, float, str]:
    """Numbers by value, then anything else by text."""
    try:
        return (0, float(v), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(v))


def scaling(runs: list[Run]) -> None:
    """Set each run's scaling efficiency against a smallest-world-size baseline (see module doc)."""
    def per_device(r: Run) -> float:
        return r.rate / r.world

    measured = [r for r in runs if r.rate]
    if not measured:
        return
    smallest = min(r.world for r in measured)
    base_runs = [r for r in measured if r.world == smallest]
    fastest = max(base_runs, key=per_device)
    for r in measured:
        same = [b for b in base_runs if b.summary.get("strategy") == r.summary.get("strategy")]
        base = max(same, key=per_device) if same else fastest
        r.efficiency = per_device(r) / per_device(base)
        r.baseline = str(base.summary.get("run_id"))


def worlds_differ(runs: list[Run]) -> bool:
    return len({r.world for r in runs}) > 1


def columns(runs: list[Run], sweep: Sweep | None, short: bool) -> list[str]:
    """The table's header: long names for report.md, short ones for the console."""
    unit = "samples/s" if all(r.classifier for r in runs) else "tokens/s"
    per_dev = ("tok/s/dev" if unit == "tokens/s" else "samples/s/dev") if short else f"{unit} per device"
    head = ["run", "status"]
    if sweep is not None:
        arrow = "↑" if sweep.direction == "maximize" else "↓"
        head += [*sweep.keys, "train loss", "val loss", f"{sweep.objective} {arrow}", "best", "rank"]
    head += ["strategy", "hardware", "world" if short else "world size", unit, per_dev]
    if worlds_differ(runs):
        head.append("eff." if short else "scaling eff.")
    head += ["MFU", "peak mem" if short else "peak memory / rank"]
    if sweep is None:
        head += ["train loss", "val loss"]
    return head


def comparison_rows(runs: list[Run], base: Path, sweep: Sweep | None = None) -> list[list[str]]:
    order, tie = ranking(runs, sweep) if sweep is not None else ([], None)
    rank = {id(r): i for i, r in enumerate(order, 1)}
    rows = []
    for r in runs:
        mem, kind = r.peak_memory()
        try:
            name = str(r.path.relative_to(base))
        except ValueError:
            name = r.path.name  # the run id; the full paths are listed under the table
        losses = [_num(r.summary.get("final_loss"), ".4f"), _num(r.val_loss, ".4f")]
        row = [title(r, sweep) if sweep is not None else name, str(r.summary.get("status"))]
        if sweep is not None:
            params = sweep.params.get(r.path) or {}
            row += [str(params.get(k, "")) for k in sweep.keys]
            best = "tied" if tie is not None and id(r) in rank else "★" if rank.get(id(r)) == 1 else ""
            row += [*losses, _objective_cell(r, sweep), best, str(rank.get(id(r), ""))]
        rate = r.rate
        row += [str(r.summary.get("strategy")), str(r.summary.get("hardware")), str(r.world),
                _num(rate, ",.1f" if r.classifier else ",.0f"),
                _num(rate / r.world if rate is not None else None, ",.1f" if r.classifier else ",.0f")]
        if worlds_differ(runs):
            row.append(_num(r.efficiency, ".2f"))
        row += [_pct(r.mfu), _num(mem, ".2f", f" GB {kind}")]
        rows.append(row if sweep is not None else [*row, *losses])
    return rows


def _objective_cell(r: Run, sweep: Sweep) -> str:
    """The trial's objective value; a completed trial that no evaluation scored says so."""
    value = objective_of(r.summary, sweep.objective, r.path)
    if value is None and eval_objective(sweep.objective) and r.summary.get("status") == "completed":
        return "not evaluated"
    return _num(value, ".4f")


def trial_bars(runs: list[Run], sweep: Sweep) -> tuple[list[TrialBar], str, str]:
    """(one bar per trial in the table's order, the throughput unit, the memory kind) for trials.png."""
    unit = "samples/s" if all(r.classifier for r in runs) else "tokens/s"
    kinds = {kind for r in runs if (kind := r.peak_memory()[1])}
    bars = [TrialBar(title(r, sweep).removesuffix(" ↻"), r.rate, r.peak_memory()[0], resumed(r) is not None)
            for r in runs]
    return bars, unit, "/".join(sorted(kinds))


def objective_plots(runs: list[Run], sweep: Sweep, out: Path) -> list[Path]:
    """One `objective_vs_<param>.png` per swept parameter (completed trials with a value)."""
    from loom.tracking.plots import objective_plot

    best = best_run(runs, sweep)
    paths = []
    for key in sweep.keys:
        points = [(sweep.params.get(r.path, {}).get(key), objective_of(r.summary, sweep.objective, r.path), r is best)
                  for r in runs]
        points = [p for p in points if p[0] is not None and p[1] is not None]
        if points:
            safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)
            paths.append(objective_plot(points, key, sweep.objective, out / f"objective_vs_{safe}.png"))
    return paths


def comparison_report(runs: list[Run], out: Path, skipped: list[Path],
                      sweep: Sweep | None = None) -> tuple[Path, list[Path]]:
    """report.md (and its plots) in `out`; returns (report.md, the plots)."""
    plots: list[Path] = []
    if worlds_differ(runs):
        scaling(runs)
    if sweep is not None:  # in the order of the swept values
        runs.sort(key=lambda r: [_order(sweep.params.get(r.path, {}).get(k)) for k in sweep.keys] + [str(r.path)])
    else:
        runs.sort(key=lambda r: (str(r.summary.get("strategy")), r.world, str(r.path)))
    parts = [f"# {'Sweep' if sweep else 'Comparison'} of {len(runs)} runs", ""]
    if sweep is not None:
        parts += [best_line(runs, sweep), ""]
    parts += [_md_table(columns(runs, sweep, short=False), comparison_rows(runs, out, sweep)), ""]
    notes = []
    if worlds_differ(runs):
        notes.append("Scaling efficiency: tokens/s per device / that of the baseline run at the smallest world "
                     "size (same strategy if there is one, else the fastest per device); 1.00 is linear scaling.")
    notes.append("Peak memory: the most loaded rank (GPU memory on GPUs, process RSS on CPUs). "
                 "MFU is n/a where the device's peak FLOP/s is unknown.")
    if sweep is not None and any(resumed(r) for r in runs):
        notes.append("↻: " + "; ".join(f"{title(r, sweep).removesuffix(' ↻')} {resumed(r)}" for r in runs
                                       if resumed(r)) + ".")
    if sweep is not None and ranking(runs, sweep)[1] is not None:
        notes.append(f"No objective plot: the trials tie on {sweep.objective}.")
    parts += [" ".join(notes), ""]
    if sweep is not None:
        tie = ranking(runs, sweep)[1]
        plots += [] if tie is not None else objective_plots(runs, sweep, out)
        plots += [p for p in [trials_plot(*trial_bars(runs, sweep), out / "trials.png")] if p is not None]
    if worlds_differ(runs) and scaling_plot(runs, out / "scaling.png"):
        plots.append(out / "scaling.png")
    parts += [f"![{p.stem}]({p.name})\n" for p in plots]
    failed = [(r, error_text(r.summary.get("error"))) for r in runs]
    parts += [f"- {r.path.name} failed: {why}" for r, why in failed if why]
    parts += ["## Runs", ""]
    for r in runs:
        rel = os.path.relpath(r.path, out)
        link = f"[{rel}]({rel}/report.md)" if (r.path / "report.md").is_file() else rel
        parts.append(f"- {title(r, sweep)}: {link}" if sweep is not None else f"- {link}")
    if skipped:
        parts += ["", "Not included (no summary.json yet: running, or stopped before the end): "
                  + ", ".join(os.path.relpath(p, out) for p in skipped)]
    return _write(out / "report.md", "\n".join(parts) + "\n"), plots
