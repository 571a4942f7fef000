"""The report.md sections for a slow run: the profile (`<run>/profile/summary.json`, written by
the worker at the end of a `trainer.profile` window) and the ranks (the stragglers of summary.json
and the heatmap drawn from `<run>/ranks.jsonl`). No torch needed here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.rundir.paths import RunDir


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def esc(x: Any) -> str:
        return str(x).replace("|", "\\|")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(esc(c) for c in row) + " |" for row in rows)]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _mb(v: int) -> str:
    return f"{v / 2**20:,.1f} MiB"


def profile_section(run_dir: Path) -> list[str]:
    """Markdown lines: where rank 0's profiled steps spent their time, its top operators by self
    time, the allocator's peak per phase; [] when the run was not profiled."""
    path = RunDir(run_dir).profile_summary
    if not path.is_file():
        return []
    p = json.loads(path.read_text())
    steps = p.get("steps") or []
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no complete step"
    t, share = p["time_ms"], p["share"]
    lines = ["## Profile", "",
             f"Rank 0, {span} ({t['step']:,.1f} ms): traces for every rank in `profile/` "
             "(open them in https://ui.perfetto.dev or TensorBoard's profiler plugin).", "",
             *_md_table(["time in", "ms", "share"],
                        [[k.replace("_", " "), f"{t[k]:,.1f}", _pct(share[k])]
                         for k in ("compute", "communication", "data_wait")]), "",
             "Top kernels by device time:" if p.get("self_time") == "device" else "Top operators by cpu self time:", "",
             *_md_table(["kernel" if p.get("self_time") == "device" else "operator", "self ms", "calls", "share of step time"],
                        [[o["name"], f"{o['self_ms']:,.2f}", o["calls"], _pct(o["share"])] for o in p["top_ops"]]), ""]
    peaks = p.get("memory_peak_bytes_per_phase")
    if peaks:
        devices = sorted({d for v in peaks.values() for d in v})
        lines += ["Allocator peak per phase (above the window's start):", "",
                  *_md_table(["phase", *devices], [[ph, *(_mb(peaks[ph].get(d, 0)) for d in devices)]
                                                   for ph in ("forward", "backward", "optimizer") if ph in peaks]), ""]
    if p.get("memory_snapshot"):
        peak = p.get("cuda_max_allocated_bytes")
        lines += [f"CUDA memory snapshot: `profile/{p['memory_snapshot']}` (drag it into "
                  f"https://pytorch.org/memory_viz)" + (f"; peak allocated {_mb(peak)}" if peak else "") + ".", ""]
    return lines


def ranks_section(run_dir: Path, summary: dict) -> list[str]:
    """Markdown lines: the heatmap of every rank's own time and the stragglers named, if any;
    [] for a one-rank run or one without the record (or without matplotlib)."""
    from loom.packages import installed

    if not installed("matplotlib"):
        return []
    from loom.tracking.heatmap import rank_heatmap

    try:
        path = rank_heatmap(run_dir)
    except Exception as e:  # a report without the picture is still a report
        print(f"warning: rank heatmap not drawn ({type(e).__name__}: {e})")
        return []
    if path is None:
        return []
    found = summary.get("stragglers") or []
    lines = ["## Ranks", "", "Each rank's own time per log step (data wait + forward): a straggler is a bright row.", "",
             f"![ranks](plots/{path.name})", ""]
    if found:
        lines += _md_table(["straggler rank", "host", "slowdown (of a step)", "cause", "since step"],
                           [[s["rank"], s["host"], _pct(s["slowdown"]), s["cause"], s["first_step"]] for s in found])
    else:
        lines += ["No straggler: no rank stayed slower than the threshold (tracking.straggler_threshold)."]
    return [*lines, ""]
