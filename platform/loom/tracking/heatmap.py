"""`plots/ranks.png`: each rank's own time per log step (data wait + forward, the part a slow
rank does not share with the others) as a ranks x steps heatmap, so a bad rank is a bright row."""

from __future__ import annotations

from pathlib import Path

from loom.rundir.paths import RunDir
from loom.tracking.plots import _save
from loom.tracking.stragglers import read_ranks


def rank_heatmap(run_dir: Path) -> Path | None:
    """Draw it from `<run>/ranks.jsonl`; None for a run with one rank or no record."""
    rows = read_ranks(run_dir)
    world = max((len(r["step_ms"]) for r in rows), default=0)
    if world < 2:
        return None
    import numpy as np
    from matplotlib.figure import Figure

    grid = np.full((world, len(rows)), np.nan)
    for j, r in enumerate(rows):
        for i, (d, c) in enumerate(zip(r["data_wait_ms"], r["compute_ms"], strict=True)):
            grid[i, j] = d + c
    fig = Figure(figsize=(8, 1.2 + 0.35 * world), dpi=100)
    ax = fig.subplots()
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma",
                      extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, world - 0.5, -0.5))
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    ax.set_yticks(range(world))
    ax.set_title(f"{Path(run_dir).name}: each rank's own time (data wait + forward), ms")
    fig.colorbar(image, ax=ax, label="ms")
    out = RunDir(run_dir).plots
    out.mkdir(parents=True, exist_ok=True)
    return _save(fig, out / "ranks.png")
