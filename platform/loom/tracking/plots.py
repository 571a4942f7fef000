"""`<run>/plots/{loss,throughput,utilization}.png` from `<run>/metrics.csv`.

No torch here (the report verb uses it too), and matplotlib is imported only when a plot is
drawn. Figures are made with `matplotlib.figure.Figure` directly rather than pyplot, so no
GUI backend or global figure state is involved (the Agg canvas renders the PNG).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

PLOTS = ("loss.png", "throughput.png", "utilization.png")


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """metrics.csv as rows of floats (empty cells dropped), sorted by step."""
    path = Path(run_dir) / "metrics.csv"
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


def _figure(nrows: int, title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.8 * nrows + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, axes


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def _loss(rows, title: str, path: Path) -> Path:
    fig, (ax,) = _figure(1, f"{title}: loss")
    xs, ys = _series(rows, "train/loss")
    if xs:
        ax.plot(xs, ys, label="train/loss", color="tab:blue")
    vx, vy = _series(rows, "val/loss")
    if vx:
        ax.plot(vx, vy, "o-", label="val/loss", color="tab:orange")
    if xs or vx:
        ax.legend()
    else:
        _no_data(ax, "loss")
    ax.set_ylabel("loss")
    return _save(fig, path)


def _throughput(rows, title: str, path: Path) -> Path:
    fig, (ax1, ax2) = _figure(2, f"{title}: throughput")
    xs, ys = _series(rows, "perf/tokens_per_sec")
    if xs:
        ax1.plot(xs, ys, color="tab:green", label="tokens/s (all devices)")
        ax1.legend()
    else:
        _no_data(ax1, "throughput")
    ax1.set_ylabel("tokens/s")
    ax1.set_ylim(bottom=0)
    xs, ys = _series(rows, "perf/step_time_ms")
    if xs:
        ax2.plot(xs, ys, color="tab:purple", label="step time (mean over ranks)")
        lo = [r for r in rows if "perf/step_time_ms_min" in r and "perf/step_time_ms_max" in r]
        if lo:
            ax2.fill_between([r["step"] for r in lo], [r["perf/step_time_ms_min"] for r in lo],
                             [r["perf/step_time_ms_max"] for r in lo], color="tab:purple", alpha=0.2,
                             label="min-max over ranks")
        wx, wy = _series(rows, "perf/data_wait_ms")
        if wx:
            ax2.plot(wx, wy, color="tab:gray", label="data wait")
        ax2.legend()
    else:
        _no_data(ax2, "step time")
    ax2.set_ylabel("ms / step")
    ax2.set_ylim(bottom=0)
    return _save(fig, path)


def _utilization(rows, title: str, path: Path) -> Path:
    gpu = any("sys/gpu_util" in r for r in rows)
    mfu = any("perf/mfu" in r for r in rows)
    n = 2 + int(gpu) + int(mfu)
    fig, axes = _figure(n, f"{title}: utilization")
    ax = axes[0]
    xs, ys = _series(rows, "sys/cpu_percent")
    if xs:
        ax.plot(xs, ys, color="tab:red", label="CPU % per rank (mean; 100 = one core)")
        ax.legend()
    else:
        _no_data(ax, "CPU utilization")
    ax.set_ylabel("CPU %")
    ax.set_ylim(bottom=0)
    ax = axes[1]
    xs, ys = _series(rows, "sys/rss_gb")
    if xs:
        ax.plot(xs, ys, color="tab:brown", label="RSS per rank (mean)")
        mx, my = _series(rows, "sys/rss_gb_max")
        if mx:
            ax.plot(mx, my, "--", color="tab:brown", alpha=0.6, label="RSS (max rank)")
        if gpu:
            gx, gy = _series(rows, "sys/gpu_mem_gb")
            ax.plot(gx, gy, color="tab:cyan", label="GPU memory reserved")
        ax.legend()
    else:
        _no_data(ax, "memory")
    ax.set_ylabel("GB")
    ax.set_ylim(bottom=0)
    i = 2
    if gpu:
        ax = axes[i]
        xs, ys = _series(rows, "sys/gpu_util")
        ax.plot(xs, ys, color="tab:olive", label="GPU util %")
        ax.set_ylabel("GPU %")
        ax.set_ylim(0, 105)
        ax.legend()
        i += 1
    if mfu:
        ax = axes[i]
        xs, ys = _series(rows, "perf/mfu")
        ax.plot(xs, [100 * y for y in ys], color="tab:pink", label="MFU")
        ax.set_ylabel("MFU %")
        ax.set_ylim(bottom=0)
        ax.legend()
    return _save(fig, path)


def write_plots(run_dir: Path) -> list[Path]:
    """Draw the run's plots from metrics.csv; returns the paths written ([] without metrics)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        return []
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title = run_dir.name
    return [
        _loss(rows, title, out / "loss.png"),
        _throughput(rows, title, out / "throughput.png"),
        _utilization(rows, title, out / "utilization.png"),
    ]
