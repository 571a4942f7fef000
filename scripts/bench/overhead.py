#!/usr/bin/env python
"""Loom's per-step cost on one process vs a plain PyTorch loop over the same model.

`loom train strategy=single hardware.devices=1` (Lightning, Loom's callbacks, the in-process
launch) against plain_gpt.py: the same GPT (loom.models.gpt.network, the only Loom import of that
side), the same token file, sampler order, AdamW groups and schedule, clipping and seed, and
the same thread count (cores // processes, as Loom's worker sets it).

The estimator (_turns.py, baton.py): both sides train at once and take turns step by step, so
each Loom step has a plain step as its neighbour in time; each side times its own steps (wall
and process CPU); per repeat the median of the paired ratios (the headline), the medians,
per-log-window means (log and GC steps in) and CPU per step; over repeats a geometric mean
with a 95% interval.
`--estimator difference` is the former one: runs of N and 2N steps, (t2N - tN) / N.

Legs (`--monitors`): none (tracker, stragglers and hang watchdog off), default (Loom's
defaults, tracking=none: the historical leg) and all (tracking=offline, stragglers and hang
watchdog on, profiler off). `--prices`: each monitor on vs all off, Loom against Loom.
`--slow-loom 0.03` adds a sleep of 3% of each Loom step's time to it (`--slow-plain`: to the
plain side; `--slow-kind spin` burns CPU instead): what the estimator must detect.
Target (read, not asserted): ratio <= 1.03 with the interval's upper end under 1.05.

    .venv/bin/python scripts/bench/overhead.py [--model gpt_small] [--steps 40] [--repeats 4] [--monitors all]
"""

from __future__ import annotations

import argparse
import sys

from _bench import compare_per_step, write_json
from _turns import LEGS, Side, compare_in_turns, overrides_of, prices


def add_common(ap: argparse.ArgumentParser, steps: int, repeats: int) -> None:
    """The arguments overhead.py and ddp_parity.py share."""
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=steps, help=f"steps per run (default {steps})")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--estimator", choices=["turns", "difference"], default="turns")
    ap.add_argument("--monitors", choices=sorted(LEGS), default="default")
    ap.add_argument("--prices", nargs="*", metavar="MONITOR",
                    help="each monitor's price instead (Loom on vs off); names filter the list")
    ap.add_argument("--slow-loom", type=float, default=0.0, metavar="FRACTION")
    ap.add_argument("--slow-plain", type=float, default=0.0, metavar="FRACTION")
    ap.add_argument("--slow-kind", choices=["sleep", "spin"], default="sleep")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed temp dir)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for `loom train` (both sides read them)")


def run(name: str, args: argparse.Namespace, base: list[str], nproc: int) -> dict:
    """One benchmark's measurement as its arguments ask; the result as JSON-ready data."""
    base = [*base, f"model={args.model}", *args.overrides]
    if args.prices is not None:
        return {"name": name, "prices": prices(name, base, nproc, args.steps, args.repeats, args.keep, args.prices)}
    loom = [*base, *overrides_of(LEGS[args.monitors])]
    if args.estimator == "difference":
        res = compare_per_step(name, loom, nproc, args.steps, args.repeats, keep=args.keep)
    else:
        a = Side(f"loom (monitors {args.monitors})", loom, args.slow_loom, args.slow_kind)
        b = Side("plain PyTorch", None, args.slow_plain, args.slow_kind)
        res = compare_in_turns(name, a, b, nproc, args.steps, args.repeats, loom, keep=args.keep)
    res["monitors"], res["target"] = args.monitors, "ratio <= 1.03, interval's upper end < 1.05"
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, steps=40, repeats=4)
    args = ap.parse_args(argv)
    res = run("overhead", args, ["strategy=single", "hardware=cpu", "hardware.devices=1"], 1)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
