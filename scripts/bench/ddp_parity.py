#!/usr/bin/env python
"""Loom's DDP at 2 ranks vs a plain torchrun + torch DDP script, per-step cost.

`loom train strategy=ddp hardware=cpu hardware.devices=2 tracking=none` (launcher ->
torchrun -> Loom worker -> Lightning DDPStrategy over gloo) against plain_gpt.py under
`torchrun --nproc-per-node=2`: torch DistributedDataParallel (gloo, the same 25 MB buckets),
DistributedSampler with the same seed, the same GPT, AdamW, schedule, clipping and seed,
and the same threads per rank (cores // ranks).

Per-step cost by difference of runs of N and 2N steps, (t2N - tN) / N; Loom's time is
summary.json's `train_time_s` (rank 0's training loop), the plain side's is rank 0's loop
time; whole-command wall times give a cross-check. Interleaved loom N, plain N, loom 2N,
plain 2N, ... Final losses are Loom's summary definition (last logging window, mean over
ranks) on both sides. Target (read, not asserted): ratio <= 1.03.

    .venv/bin/python scripts/bench/ddp_parity.py [--model gpt_small] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys

from _bench import compare_per_step, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=20, help="N: runs of N and 2N steps (default 20)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed temp dir)")
    ap.add_argument("overrides", nargs="*", help="extra overrides for `loom train` (both sides read them)")
    args = ap.parse_args(argv)
    overrides = ["strategy=ddp", "hardware=cpu", f"hardware.devices={args.ranks}", "tracking=none",
                 f"model={args.model}", *args.overrides]
    res = compare_per_step("ddp_parity", overrides, args.ranks, args.steps, args.repeats, keep=args.keep)
    res["target"] = "ratio <= 1.03"
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
