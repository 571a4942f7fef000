#!/usr/bin/env python
"""`loom plan --compare`'s predicted step times against measured ones, layout by layout.

Lists the layouts `loom plan --compare` ranks for the given world (on CPU by default:
hardware=cpu, gloo), trains each one with exactly the overrides the comparison prints (so the
global batch is the same for all), and reads the measured step time from the run's own
metrics: the median of `perf/step_time_ms` over the steps after `--warmup` (the first steps
build the schedule, allocate and warm the allocator). Prints predicted and measured per
layout, their ratio, both rankings, Spearman's rank correlation and every pair the two order
differently although their measured times differ by more than `--tie` (closer pairs are
ties: the machine's noise). Nothing asserts a time; the figures go to docs/benchmarks.md.

    .venv/bin/python scripts/bench/layouts.py                      # gpt_tiny, 4 layers, world 4
    .venv/bin/python scripts/bench/layouts.py --world 2 --steps 12
    .venv/bin/python scripts/bench/layouts.py --only ddp,fsdp,pp    # a subset, by strategy name
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _bench import Failed, cleanup, fresh_root, load, run_loom, write_json


def measured_step_ms(run_dir: Path, warmup: int) -> float:
    """Median `perf/step_time_ms` of the logged steps after `warmup` (rank 0's own timing)."""
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/step_time_ms") and int(r["step"]) > warmup]
    return statistics.median(float(r["perf/step_time_ms"]) for r in rows)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two lists of times (ties take their mean rank)."""
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 1.0


def discordant(rows: list[dict[str, Any]], tie: float) -> list[str]:
    """Pairs the prediction orders against the measurement, beyond the measured tie margin."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            fast, slow = (a, b) if a["measured_ms"] < b["measured_ms"] else (b, a)
            if slow["measured_ms"] < fast["measured_ms"] * (1 + tie):
                continue
            if fast["predicted_ms"] > slow["predicted_ms"]:
                out.append(f"{fast['layout']} measured faster than {slow['layout']} "
                           f"({fast['measured_ms']:.0f} < {slow['measured_ms']:.0f} ms) but predicted slower")
    return out


def layout_name(c: dict[str, Any]) -> str:
    d = c["degrees"]
    return f"{c['strategy']}({d['dp_replicate']}x{d['dp_shard']}x{d['tp']}x{d['pp']})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tie", type=float, default=0.15, help="measured times closer than this fraction tie")
    ap.add_argument("--only", default="", help="comma-separated strategy names to run (default: all)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--measured", metavar="PATH", help="re-predict against the measured step times of an "
                    "earlier --json (no training): how a change of the model ranks the same runs")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("overrides", nargs="*", default=None)
    args = ap.parse_args(argv)
    from loom.compose import compose
    from loom.plan.compare import compare

    base = ["hardware=cpu", f"hardware.devices={args.world}", "model=gpt_tiny", "model.n_layer=4",
            "dataset.batch_size=4", "dataset.seq_len=128", "dataset.max_bytes=2000000", "tracking=csv",
            "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=0", "trainer.val_every_n_steps=0",
            "trainer.limit_val_batches=1", *(args.overrides or [])]
    result = compare(compose(base))
    only = {s for s in args.only.split(",") if s}
    todo = [c.to_dict() for c in result.candidates if not only or c.strategy in only]
    print(f"[layouts] {len(todo)} layouts of world {args.world}: {' '.join(base)}; "
          f"{args.steps} steps each, load {load()}", flush=True)
    if args.measured:
        done = {r["layout"]: r["measured_ms"] for r in json.loads(Path(args.measured).read_text())["rows"]}
        rows = [{"layout": layout_name(c), "overrides": c["overrides"], "predicted_ms": c["predicted_step_s"] * 1e3,
                 "measured_ms": done[layout_name(c)]} for c in todo if layout_name(c) in done]
        for row in rows:
            row["measured_over_predicted"] = row["measured_ms"] / row["predicted_ms"]
            print(f"  {row['layout']:24s} predicted {row['predicted_ms']:8.1f} ms   measured "
                  f"{row['measured_ms']:8.1f} ms   ratio {row['measured_over_predicted']:5.2f}", flush=True)
        todo = []
    root, rows = fresh_root("layouts"), rows if args.measured else []
    try:
        for i, c in enumerate(todo):
            over = [*base, *c["overrides"], f"trainer.max_steps={args.steps}"]
            try:
                s = run_loom(over, root, f"l{i}")
            except Failed as e:
                print(f"  {layout_name(c)}: FAILED\n{e}", flush=True)
                continue
            row = {"layout": layout_name(c), "overrides": c["overrides"],
                   "predicted_ms": c["predicted_step_s"] * 1e3,
                   "measured_ms": measured_step_ms(Path(s["run_dir"]), args.warmup)}
            row["measured_over_predicted"] = row["measured_ms"] / row["predicted_ms"]
            rows.append(row)
            print(f"  {row['layout']:24s} predicted {row['predicted_ms']:8.1f} ms   measured "
                  f"{row['measured_ms']:8.1f} ms   ratio {row['measured_over_predicted']:5.2f}", flush=True)
    finally:
        cleanup(root, args.keep)
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    wrong = discordant(rows, args.tie)
    print(f"predicted order: {', '.join(r['layout'] for r in sorted(rows, key=lambda r: r['predicted_ms']))}")
    print(f"measured order:  {', '.join(r['layout'] for r in sorted(rows, key=lambda r: r['measured_ms']))}")
    print(f"Spearman rank correlation {rho:.2f}; {len(wrong)} pair(s) ordered against the measurement "
          f"beyond a {args.tie:.0%} tie margin" + "".join(f"\n  - {w}" for w in wrong))
    write_json(Path(args.json) if args.json else None,
               {"rows": rows, "spearman": rho, "discordant": wrong, "load": load(),
                "rate_source": result.rate_source, "bandwidth_source": result.bandwidth_source})
    return 0


if __name__ == "__main__":
    sys.exit(main())
