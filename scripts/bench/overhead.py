#!/usr/bin/env python
"""Loom's per-step cost on one process vs a plain PyTorch loop over the same model.

`loom train strategy=single hardware.devices=1 tracking=none` (Lightning, Loom's callbacks,
the in-process launch) against plain_gpt.py: the same GPT (loom.models.gpt, the only Loom
import of that side), the same token file, sampler order, AdamW groups and schedule, clipping
and seed, and the same thread count (cores // processes, as Loom's worker sets it).

Per-step cost by difference: runs of N and 2N steps, (t2N - tN) / N, which cancels start-up,
the first steps' warm-up and the end-of-run validation. Loom's time is summary.json's
`train_time_s` (the training loop, validation excluded); the plain side's is its loop time.
The ratio of whole-command wall times (same difference) is printed as a cross-check, and the
two sides' final losses (Loom's summary definition: the mean of the last logging window)
are compared. The sides run interleaved (loom N, plain N, loom 2N, plain 2N, ...).
Target (read, not asserted): ratio <= 1.03.

    .venv/bin/python scripts/bench/overhead.py --model gpt_small --steps 50 [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

from _bench import compare_per_step, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=50, help="N: runs of N and 2N steps (default 50)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed temp dir)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for `loom train` (both sides read them)")
    args = ap.parse_args(argv)
    overrides = ["strategy=single", "hardware=cpu", "hardware.devices=1", "tracking=none",
                 f"model={args.model}", *args.overrides]
    res = compare_per_step("overhead", overrides, 1, args.steps, args.repeats, keep=args.keep)
    res["target"] = "ratio <= 1.03"
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
