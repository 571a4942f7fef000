#!/usr/bin/env python
"""Can the per-step estimator tell a 3% slowdown from none? Shown, not assumed.

Each trial measures Loom vs the plain loop in turns (overhead.py's estimator) three ways: as
they are, with a sleep of `--fraction` (3%) of each step's own time added to Loom's step
(`--slow-loom`), and with it added to the plain loop's step instead (`--slow-plain`). The
slowdown is told from none when the 95% interval of the shift (the slowed leg's ratio over the
unslowed leg's: a Welch two-sample interval on the repeats' log ratios) lies wholly above 1
(Loom slowed) or below 1 (plain slowed), on the paired wall-time estimator (a sleep costs no
CPU); expected shifts 1 + fraction and 1 / (1 + fraction). Whether the two legs' own intervals
lie apart (a stricter rule than the test: the first run here told 3% apart in 5 of 6 legs by it)
is printed beside. Legs run in the order none, loom, plain, trial after trial.

    .venv/bin/python scripts/bench/detect.py [--trials 3] [--fraction 0.03] [--ranks 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from _bench import write_json
from _turns import LEGS, Side, compare_in_turns, overrides_of, t975

METRIC = "wall_paired"  # each Loom step against its plain neighbour in time (_turns.paired)


def shift(slowed: list[float], none: list[float]) -> dict[str, float]:
    """The ratio of two legs' geometric means with its 95% Welch interval (per-repeat ratios)."""
    a, b = [math.log(x) for x in slowed], [math.log(x) for x in none]
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    d, half = statistics.fmean(a) - statistics.fmean(b), t975(max(1, int(df))) * math.sqrt(va + vb)
    return {"value": math.exp(d), "low": math.exp(d - half), "high": math.exp(d + half), "df": df}


def trial(base: list[str], nproc: int, fraction: float, steps: int, repeats: int) -> dict:
    legs, per_repeat = {}, {}
    for leg, slow_loom, slow_plain in (("none", 0.0, 0.0), ("loom", fraction, 0.0), ("plain", 0.0, fraction)):
        a = Side(f"loom{' + sleep' if slow_loom else ''}", base, slow_loom)
        b = Side(f"plain PyTorch{' + sleep' if slow_plain else ''}", None, slow_plain)
        res = compare_in_turns(f"detect-{leg}", a, b, nproc, steps, repeats, base)
        legs[leg], per_repeat[leg] = res["ratio"][METRIC], [r["ratio"][METRIC] for r in res["runs"]]
    none, up, down = legs["none"], legs["loom"], legs["plain"]
    s_up, s_down = shift(per_repeat["loom"], per_repeat["none"]), shift(per_repeat["plain"], per_repeat["none"])
    return {"legs": legs, "per_repeat": per_repeat, "up_shift": s_up, "down_shift": s_down,
            "up_detected": s_up["low"] > 1, "down_detected": s_down["high"] < 1,
            "up_apart": up["low"] > none["high"], "down_apart": down["high"] < none["low"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.03)
    ap.add_argument("--ranks", type=int, default=1, help="1: overhead.py's comparison; 2: ddp_parity.py's")
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    strategy = ["strategy=single", "hardware.devices=1"] if args.ranks == 1 else \
        ["strategy=ddp", f"hardware.devices={args.ranks}"]
    base = [*strategy, "hardware=cpu", f"model={args.model}", *overrides_of(LEGS["default"])]
    trials = []
    for t in range(args.trials):
        r = trial(base, args.ranks, args.fraction, args.steps, args.repeats)
        trials.append(r)
        legs = r["legs"]
        u, d = r["up_shift"], r["down_shift"]
        print(f"[detect] trial {t + 1}: ratio as is {legs['none']['value']:.3f} [{legs['none']['low']:.3f}, "
              f"{legs['none']['high']:.3f}]; Loom slowed {legs['loom']['value']:.3f} [{legs['loom']['low']:.3f}, "
              f"{legs['loom']['high']:.3f}], shift x{u['value']:.3f} [{u['low']:.3f}, {u['high']:.3f}]: "
              f"{'told' if r['up_detected'] else 'NOT told'} (intervals apart: {r['up_apart']}); plain slowed "
              f"{legs['plain']['value']:.3f} [{legs['plain']['low']:.3f}, {legs['plain']['high']:.3f}], shift "
              f"x{d['value']:.3f} [{d['low']:.3f}, {d['high']:.3f}]: {'told' if r['down_detected'] else 'NOT told'} "
              f"(intervals apart: {r['down_apart']})", flush=True)
    told = sum(r["up_detected"] and r["down_detected"] for r in trials)
    print(f"[detect] a {100 * args.fraction:g}% slowdown told from none in both directions in {told} of "
          f"{len(trials)} trials", flush=True)
    write_json(args.json, {"fraction": args.fraction, "ranks": args.ranks, "metric": METRIC, "trials": trials,
                           "told": told})
    return 0


if __name__ == "__main__":
    sys.exit(main())
