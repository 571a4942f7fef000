"""`loom plan --compare --rehearse`: the top layouts of the comparison rehearsed, their fit
judged again by the rehearsed peak (the plan's runtime added), and re-ranked: layouts that
fit by the rehearsal first, then the comparison's own order (predicted step time)."""

from __future__ import annotations

from typing import Any

from loom.rehearse import rehearse
from loom.rehearse.table import GB, failures

TOP = 3


def rehearsed_peak(rehearsal: dict[str, Any], plan: dict[str, Any]) -> float | None:
    """The largest rehearsed total peak over the rehearsed ranks (ZeRO: DeepSpeed's model
    states + the plan's activations); None when a rank failed."""
    if failures(rehearsal):
        return None
    if rehearsal.get("estimator"):
        return rehearsal["deepspeed_states"] + plan["memory_per_device_bytes"]["activations"]
    return max(r["bytes"]["peak"] for r in rehearsal["ranks"])


def rehearse_top(candidates: list, n: int = TOP) -> list[dict[str, Any]]:
    """--json's rows, the first `n` with `rehearsal`, `rehearsed_peak_bytes` and
    `fits_rehearsed`, re-ranked as the module docstring says; the table printed."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [c.to_dict() for c in candidates]
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:  # each rehearsal is its own process(es): side by side
        done = list(pool.map(lambda c: rehearse(c.cfg, c.plan.to_dict(), show=False), candidates[:n]))
    for c, row, rehearsal in zip(candidates[:n], rows[:n], done, strict=True):
        plan = c.plan.to_dict()
        row["rehearsal"] = rehearsal
        peak = rehearsed_peak(row["rehearsal"], plan)
        cap, runtime = row["capacity_per_device_bytes"], plan["memory_per_device_bytes"].get("runtime", 0.0)
        row["rehearsed_peak_bytes"] = peak
        row["fits_rehearsed"] = peak is not None and (cap is None or peak + runtime <= cap)
    top = sorted(rows[:n], key=lambda r: not r["fits_rehearsed"])  # stable: the comparison's order within
    runtime = {id(r): c.plan.to_dict()["memory_per_device_bytes"].get("runtime", 0.0)
               for c, r in zip(candidates[:n], rows[:n], strict=True)}
    _render(top, [runtime[id(r)] for r in top])
    return top + rows[n:]


def _render(rows: list[dict[str, Any]], runtimes: list[float]) -> None:
    """The plan's total beside the rehearsed peak plus the same runtime: the two figures the
    capacity is held to (MB when every one is under 1 GB, as small CPU layouts are)."""
    from rich.console import Console
    from rich.table import Table

    big = max(r["memory_per_device_bytes"] for r in rows) >= GB
    unit, scale = ("GB", GB) if big else ("MB", 1024.0**2)
    cap = rows[0]["capacity_per_device_bytes"]
    where = f", capacity {cap / scale:,.2f} {unit} per device" if cap is not None else ""
    t = Table(title=f"the top {len(rows)} layouts rehearsed, re-ranked by their rehearsed peaks"
                    f" (+ the plan's runtime{where})")
    for col in ("#", "layout", f"plan {unit}", f"rehearsed {unit}", "fits", "predicted step s"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, (r, runtime) in enumerate(zip(rows, runtimes, strict=True), 1):
        peak = r["rehearsed_peak_bytes"]
        step = r["predicted_step_s"]
        t.add_row(str(i), " ".join(r["overrides"]), f"{r['memory_per_device_bytes'] / scale:,.2f}",
                  "failed" if peak is None else f"{(peak + runtime) / scale:,.2f}", "yes" if r["fits_rehearsed"] else "no",
                  "?" if step is None else f"{step:.3g}")
    Console().print(t)
