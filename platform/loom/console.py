"""The one-screen summary the launcher prints at the end of `loom train`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(v: Any, spec: str = ",.1f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def print_summary(run_dir: Path, s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"loom run {s['run_id']}: {s['status']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    tp, mem = s["throughput"], s["memory"]
    peak_rss = max(mem["peak_rss_gb_per_rank"]) if mem.get("peak_rss_gb_per_rank") else None
    rows = [
        ("run dir", str(run_dir)),
        ("strategy / hardware", f"{s['strategy']} on {s['hardware']}, world size {s['world_size']} "
                                f"({s['num_nodes']} node(s))"),
        ("steps", f"{s['global_step']:,} ({s['tokens']:,} tokens, {s['samples']:,} samples)"),
        ("loss", f"{_fmt(s.get('first_loss'), '.4f')} -> {_fmt(s['final_loss'], '.4f')}"),
        ("tokens/s", _fmt(tp["tokens_per_sec"], ",.0f")),
        ("samples/s", _fmt(tp["samples_per_sec"], ",.1f")),
        ("MFU", _fmt(tp["mfu"], ".1%") if tp["mfu"] is not None else "n/a (device peak unknown)"),
        ("peak memory", f"{_fmt(peak_rss, '.2f', ' GB')} RSS per rank (max)"),
        ("time", f"{_fmt(s['train_time_s'], ',.1f', ' s')} training, {_fmt(s['wall_time_s'], ',.1f', ' s')} wall"),
    ]
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from", f"step {s['resumed_from_step']}"))
    if s.get("final_weights"):
        rows.append(("final weights", str(run_dir / s["final_weights"])))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
