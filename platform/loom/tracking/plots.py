"""`<run>/plots/{loss,throughput,utilization}.png` from `<run>/metrics.csv`, and `eval.png` from the
run's evaluations (summary.json `eval`, `<run>/eval/step-*.json`) beside the loss.

No torch here (the report verb uses it too), and matplotlib is imported only when a plot is
drawn. Figures are made with `matplotlib.figure.Figure` directly rather than pyplot, so no
GUI backend or global figure state is involved (the Agg canvas renders the PNG).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom.atomic import atomic_path
from loom.rundir.eval_results import eval_results
from loom.rundir.paths import RunDir
from loom.rundir.summary import read_summary

PLOTS = ("loss.png", "eval.png", "throughput.png", "utilization.png")
EVAL_PANELS = 8   # at most this many (task, metric) panels in eval.png: the report's table has every one


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """metrics.csv as rows of floats (empty cells dropped), sorted by step."""
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return []
    rows: list[dict[str, float]] = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, float] = {}
            for k, v in raw.items():
                if k is None or v in (None, ""):
                    continue
                try:
                    x = float(v)
                except ValueError:
                    continue
                if math.isfinite(x):
                    row[k] = x
            if "step" in row:
                rows.append(row)
    rows.sort(key=lambda r: r["step"])
    return rows


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    xs = [r["step"] for r in rows if key in r]
    ys = [r[key] for r in rows if key in r]
    return xs, ys


def per_source_keys(rows: list[dict[str, float]]) -> list[str]:
    """The `val/loss/<source>` columns (a mixture's per-source validation), in name order: never
    picked as `val/loss` itself, whose series is the exact key."""
    return sorted({k for r in rows for k in r if k.startswith("val/loss/")})


def _figure(nrows: int, title: str):
    from matplotlib.figure import Figure

    height = 2.8 * nrows + 0.6
    fig = Figure(figsize=(8, height), dpi=100)
    # Fixed margins, in inches (room for the title, the x label and 6-digit tick labels):
    # matplotlib's constrained layout measures every text to place them, 40% of the drawing time.
    fig.subplots_adjust(left=0.11, right=0.98, top=1 - 0.5 / height, bottom=0.5 / height, hspace=0.15)
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, axes


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def _panel(ax, rows, key: str, *, label: str, color: str, ylabel: str, missing: str,
           more: Callable[[Any], None] | None = None, ymin: float | None = 0) -> None:
    """One axis: the series `key` (and whatever `more` adds), else a "no ... recorded" note."""
    xs, ys = _series(rows, key)
    if xs:
        ax.plot(xs, ys, color=color, label=label)
        if more is not None:
            more(ax)
        ax.legend()
    else:
        ax.text(0.5, 0.5, f"no {missing} recorded", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    ax.set_ylabel(ylabel)
    if ymin is not None:
        ax.set_ylim(bottom=ymin)


def _loss(rows, title: str, path: Path) -> Path:
    fig, (ax,) = _figure(1, f"{title}: loss")

    def val(ax) -> None:
        vx, vy = _series(rows, "val/loss")
        if vx:
            ax.plot(vx, vy, "o-", label="val/loss", color="tab:orange")
        for key in per_source_keys(rows):  # a mixture's sources, dashed beside the overall one
            ax.plot(*_series(rows, key), "o--", markersize=3, linewidth=1, label=key)

    _panel(ax, rows, "train/loss", label="train/loss", color="tab:blue", ylabel="loss", missing="loss", more=val,
           ymin=None)
    return _save(fig, path)


def _throughput(rows, title: str, path: Path) -> Path:
    fig, (ax1, ax2) = _figure(2, f"{title}: throughput")
    _panel(ax1, rows, "perf/tokens_per_sec", label="tokens/s (all devices)", color="tab:green",
           ylabel="tokens/s", missing="throughput")

    def spread_and_wait(ax) -> None:
        lo = [r for r in rows if "perf/step_time_ms_min" in r and "perf/step_time_ms_max" in r]
        if lo:
            ax.fill_between([r["step"] for r in lo], [r["perf/step_time_ms_min"] for r in lo],
                            [r["perf/step_time_ms_max"] for r in lo], color="tab:purple", alpha=0.2,
                            label="min-max over ranks")
        wx, wy = _series(rows, "perf/data_wait_ms")
        if wx:
            ax.plot(wx, wy, color="tab:gray", label="data wait")

    _panel(ax2, rows, "perf/step_time_ms", label="step time (mean over ranks)", color="tab:purple",
           ylabel="ms / step", missing="step time", more=spread_and_wait)
    for step, before, after in world_changes(rows):  # a run resumed at another world size
        for ax in (ax1, ax2):
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=1)
        ax1.annotate(f"world {before}→{after}", (step, 1.0), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=8, color="tab:red")
    return _save(fig, path)


def world_changes(rows: list[dict]) -> list[tuple[float, int, int]]:
    """(step, world before, world after) wherever `sys/world_size` changes between logged steps:
    the change is drawn at the last step of the old world (where the new one resumed)."""
    out, prev = [], None
    for r in rows:
        w = r.get("sys/world_size")
        if w is None:
            continue
        if prev is not None and int(w) != int(prev[1]):
            out.append((prev[0], int(prev[1]), int(w)))
        prev = (r["step"], w)
    return out


def _utilization(rows, title: str, path: Path) -> Path:
    gpu = any("sys/gpu_util" in r for r in rows)
    mfu = any("perf/mfu" in r for r in rows)
    fig, axes = _figure(2 + int(gpu) + int(mfu), f"{title}: utilization")
    _panel(axes[0], rows, "sys/cpu_percent", label="CPU % per rank (mean; 100 = one core)", color="tab:red",
           ylabel="CPU %", missing="CPU utilization")

    def max_rank_and_gpu(ax) -> None:
        mx, my = _series(rows, "sys/rss_gb_max")
        if mx:
            ax.plot(mx, my, "--", color="tab:brown", alpha=0.6, label="RSS (max rank)")
        if gpu:
            ax.plot(*_series(rows, "sys/gpu_mem_gb"), color="tab:cyan", label="GPU memory reserved")

    _panel(axes[1], rows, "sys/rss_gb", label="RSS per rank (mean)", color="tab:brown", ylabel="GB",
           missing="memory", more=max_rank_and_gpu)
    i = 2
    if gpu:
        _panel(axes[i], rows, "sys/gpu_util", label="GPU util %", color="tab:olive", ylabel="GPU %", missing="")
        axes[i].set_ylim(0, 105)
        i += 1
    if mfu:
        pct = [{"step": r["step"], "mfu_pct": 100 * r["perf/mfu"]} for r in rows if "perf/mfu" in r]
        _panel(axes[i], pct, "mfu_pct", label="MFU", color="tab:pink", ylabel="MFU %", missing="")
    return _save(fig, path)


def eval_series(results: list[dict]) -> dict[tuple[str, str], list[tuple[float, float, float | None]]]:
    """(task, metric) -> [(step, value, stderr)] of the evaluations with a step (failed ones have no score)."""
    out: dict[tuple[str, str], list[tuple[float, float, float | None]]] = {}
    for r in results:
        step = r.get("step")
        if r.get("error") or not isinstance(step, (int, float)):
            continue
        for task, t in (r.get("tasks") or {}).items():
            for metric, v in (t.get("metrics") or {}).items():
                err = _as_float((t.get("stderr") or {}).get(metric))
                if _as_float(v) is not None:
                    out.setdefault((task, metric), []).append((float(step), float(v), err))
    return dict(sorted(out.items()))


def _eval(rows, series, title: str, path: Path) -> Path:
    """The loss on top, then one panel per (task, metric): its score per step, stderr as error bars."""
    shown = list(series.items())[:EVAL_PANELS]
    fig, axes = _figure(1 + len(shown), f"{title}: evaluation")
    _panel(axes[0], rows, "train/loss", label="train/loss", color="tab:blue", ylabel="loss", missing="loss", ymin=None)
    for ax, ((task, metric), points) in zip(axes[1:], shown, strict=True):
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        errs = [p[2] or 0.0 for p in points]
        ax.errorbar(xs, ys, yerr=errs if any(errs) else None, fmt="o-", capsize=3, color="tab:green",
                    label=f"{task} {metric}")
        if min(ys) > 0 and max(ys) / min(ys) >= 10:  # a perplexity falling by decades
            ax.set_yscale("log")
        ax.set_ylabel(metric)
        ax.legend()
    return _save(fig, path)


def write_eval_plot(run_dir: Path, summary: dict | None = None) -> Path | None:
    """`plots/eval.png` when the run has evaluations with a step (None: none to draw)."""
    run_dir = Path(run_dir)
    series = eval_series(eval_results(run_dir, summary if summary is not None else read_summary(run_dir)))
    if not series:
        return None
    out = RunDir(run_dir).plots
    out.mkdir(parents=True, exist_ok=True)
    return _eval(read_metrics(run_dir), series, run_dir.name, out / "eval.png")


def write_plots(run_dir: Path) -> list[Path]:
    """Draw the run's plots from metrics.csv (and its evaluations); returns the paths written
    ([] without metrics or evaluations)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    evals = write_eval_plot(run_dir)
    if not rows:
        return [evals] if evals else []
    out = RunDir(run_dir).plots
    out.mkdir(parents=True, exist_ok=True)
    title = run_dir.name
    return [
        _loss(rows, title, out / "loss.png"),
        *([evals] if evals else []),
        _throughput(rows, title, out / "throughput.png"),
        _utilization(rows, title, out / "utilization.png"),
    ]


def _as_float(v: object) -> float | None:
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def objective_plot(points: list[tuple[object, float, bool]], param: str, objective: str, path: Path) -> Path:
    """A sweep's objective against one swept parameter: (value, objective, is best) per trial.
    Numeric values on a log axis when they are positive and span a decade or more (a learning
    rate), else linear; other values (strategy=ddp,zero2) as categories. The best is starred."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    xs = [_as_float(v) for v, _, _ in points]
    numeric = all(x is not None for x in xs)
    if not numeric:  # categories in the order given
        names = list(dict.fromkeys(str(v) for v, _, _ in points))
        xs = [float(names.index(str(v))) for v, _, _ in points]
        ax.set_xticks(range(len(names)), names)
    elif min(xs) > 0 and max(xs) / min(xs) >= 10:
        ax.set_xscale("log")
    order = sorted(range(len(points)), key=lambda i: xs[i])
    ax.plot([xs[i] for i in order], [points[i][1] for i in order], "o-" if numeric else "o", color="tab:blue")
    for x, (v, y, best) in zip(xs, points, strict=True):
        if best:
            ax.plot([x], [y], "*", markersize=16, color="tab:orange", label=f"best: {param}={v}")
    ax.set_xlabel(param)
    ax.set_ylabel(objective)
    ax.grid(True, alpha=0.3, which="both")
    if any(b for _, _, b in points):
        ax.legend()
    ax.set_title(f"{objective} vs {param}")
    return _save(fig, path)

