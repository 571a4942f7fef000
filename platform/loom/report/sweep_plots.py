"""The plots of a comparison: each trial's throughput and peak memory (`trials.png`) and
throughput against world size (`scaling.png`).

`trials.png` is what a sweep over strategies or hardware is for: the trials' losses tie by
design, so the objective plot is a flat row of dots, while throughput and memory differ. It is
drawn from plain numbers the comparison passes in (`TrialBar`: a trial titled by its swept
values, "strategy=fsdp", not its run id; a resumed trial hatched), on a matplotlib `Figure`
(no pyplot global state), so a test can read back what was drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.atomic import atomic_path
from loom.report.runs import Run

RESUMED_HATCH = "//"


@dataclass
class TrialBar:
    label: str              # the trial's swept values ("strategy=fsdp")
    rate: float | None      # tokens/s (samples/s for a classifier); None: not measured
    memory_gb: float | None  # peak memory of the most loaded rank
    resumed: bool           # resumed from a checkpoint or restarted: hatched, "(resumed)" in its label


def trials_figure(bars: list[TrialBar], unit: str, memory_kind: str) -> Any:
    """Two panels of one bar per trial, in the table's order: throughput, then peak memory."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(max(8.0, 2.0 + 1.6 * len(bars)), 4.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    labels = [b.label + (" (resumed)" if b.resumed else "") for b in bars]
    panels = ((axes[0], [b.rate for b in bars], unit, f"{unit} per trial (higher is faster)", "tab:blue", ",.0f"),
              (axes[1], [b.memory_gb for b in bars], f"GB ({memory_kind})" if memory_kind else "GB",
               "peak memory per trial (lower is leaner)", "tab:orange", ".2f"))
    for ax, values, ylabel, title, color, fmt in panels:
        rects = ax.bar(range(len(bars)), [v or 0.0 for v in values], color=color)
        for rect, bar in zip(rects, bars, strict=True):
            rect.set_hatch(RESUMED_HATCH if bar.resumed else "")
        ax.bar_label(rects, labels=[format(v, fmt) if v is not None else "n/a" for v in values], fontsize=8)
        ax.set_xticks(range(len(bars)), labels, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    if any(b.resumed for b in bars):
        axes[1].legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=RESUMED_HATCH, label="resumed")])
    return fig


def trials_plot(bars: list[TrialBar], unit: str, memory_kind: str, path: Path) -> Path | None:
    """`trials.png` (None: no trial has a throughput or a peak memory to draw)."""
    if not any(b.rate is not None or b.memory_gb is not None for b in bars):
        return None
    with atomic_path(path) as tmp:
        trials_figure(bars, unit, memory_kind).savefig(tmp, format="png")
    return path


def scaling_plot(runs: list[Run], path: Path) -> Path | None:
    """Throughput against world size, one line per strategy, and linear scaling from the
    fastest run per device at the smallest world size."""
    measured = [r for r in runs if r.rate]
    if not measured:
        return None
    from matplotlib.figure import Figure

    unit = "samples/s" if all(r.classifier for r in measured) else "tokens/s"

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    by_strategy: dict[str, list[Run]] = {}
    for r in measured:
        by_strategy.setdefault(str(r.summary.get("strategy")), []).append(r)
    for name, group in sorted(by_strategy.items()):
        group.sort(key=lambda r: r.world)
        ax.plot([r.world for r in group], [r.rate for r in group], "o-", label=name)
    worlds = sorted({r.world for r in measured})
    smallest = worlds[0]
    base = max((r for r in measured if r.world == smallest), key=lambda r: r.rate / r.world)
    ax.plot(worlds, [base.rate / base.world * w for w in worlds], "--", color="gray",
            label=f"linear from world size {smallest}")
    ax.set_xlabel("world size (devices)")
    ax.set_ylabel(unit)
    ax.set_xticks(worlds)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("throughput vs world size")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
