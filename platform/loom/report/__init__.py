"""`loom report PATH...`: a markdown report of one run, or a comparison of several.

One run dir -> `<run>/report.md`: the summary as a table and the run's plots (`runs.py`).
A sweep dir (a dir whose children are run dirs, e.g. runs/<exp>/sweeps/<id>/) or several
run dirs -> a table with one row per run (`compare.py`: for a sweep, its swept values, losses,
objective and best trial), printed and written to `report.md` with its plots in the sweep dir,
or in `--out` (default: the current directory) for run dirs given one by one.

Reads only files (summary.json, config.yaml, plan.json, metrics.csv, manifest.json): no torch
import, so it is fast and works on a machine without the training stack's accelerators.
"""

from __future__ import annotations

from pathlib import Path

from loom.errors import ConfigError
from loom.report.compare import best_line, columns, comparison_report, read_sweep, worlds_differ
from loom.report.runs import Run, collect, load_run, run_report, summary_rows
from loom.schema import SUMMARY_METRICS, eval_objective, objective_direction

__all__ = ["Run", "collect", "load_run", "report", "run_report", "summary_rows"]


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=bool(header[0]))
    for i, h in enumerate(header):
        t.add_column(h, style="bold" if i == 0 and not h else None, no_wrap=True)
    for r in rows:
        t.add_row(*r)
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 200))
    console.print(t)


def report(paths: list[str | Path], out: str | Path | None = None, objective: str | None = None,
           direction: str | None = None) -> int:
    """The `loom report` verb; returns the exit code (errors raise ConfigError: exit 2). `objective`
    (and `direction`): rank a sweep's trials by that summary.json metric instead of the sweep's own."""
    from loom.report.compare import comparison_rows

    paths = [Path(p) for p in paths]
    if direction is not None and objective is None:
        raise ConfigError("loom report: --direction goes with --objective (e.g. --objective validation.loss).")
    if objective is not None and objective not in SUMMARY_METRICS and eval_objective(objective) is None:
        raise ConfigError(f"loom report: --objective {objective} is not a summary.json metric; valid choices: "
                          f"{', '.join(SUMMARY_METRICS)}, or eval/<task>/<metric> (an evaluation score).")
    if objective is not None and direction is None and objective_direction(objective) is None:
        raise ConfigError(f"loom report: is a higher or a lower {objective} better? Add --direction maximize "
                          "or --direction minimize.")
    runs, sweep_dir, skipped = collect(paths)
    if objective is not None and read_sweep(sweep_dir) is None:
        raise ConfigError(f"loom report: --objective ranks a sweep's trials; {', '.join(map(str, paths))} is not a "
                          "sweep dir (runs/<experiment>/sweeps/<id>/, with its manifest.json).")
    if sweep_dir is None and len(runs) == 1 and out is None:
        run = runs[0]
        path = run_report(run)
        _print_table(f"loom run {run.summary.get('run_id')}: {run.summary.get('status')}",
                     ["", ""], [list(r) for r in summary_rows(run)])
        print(f"report: {path}")
        return 0
    out_dir = Path(out) if out is not None else (sweep_dir if sweep_dir is not None else Path.cwd())
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"loom report: cannot create the output dir {out_dir} ({e.strerror}).") from None
    out_dir = out_dir.resolve()
    for r in runs:  # each run's own report too, so the comparison can link to it
        try:
            run_report(r)
        except OSError as e:
            print(f"warning: no report.md for {r.path} ({e.strerror})")
    sweep = read_sweep(sweep_dir)
    if sweep is not None and objective is not None:
        sweep.objective = objective
        sweep.direction = direction or objective_direction(objective) or "minimize"
    path, plots = comparison_report(runs, out_dir, skipped, sweep)
    title = f"{len(runs)} runs" + (" (scaling eff.: tokens/s per device vs the smallest world size)"
                                   if worlds_differ(runs) else "")
    _print_table(title, columns(runs, sweep, short=True), comparison_rows(runs, out_dir, sweep))
    if sweep is not None:
        print(best_line(runs, sweep))
    print(f"report: {path}")
    for png in plots:
        print(f"{'scaling plot' if png.name == 'scaling.png' else 'plot'}: {png}")
    return 0
