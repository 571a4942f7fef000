#!/usr/bin/env python
"""Loom's DDP at 2 ranks vs a plain torchrun + torch DDP script, per-step cost.

`loom train strategy=ddp hardware=cpu hardware.devices=2` (launcher -> torchrun -> Loom worker
-> Lightning DDPStrategy over gloo) against plain_gpt.py under `torchrun --nproc-per-node=2`:
torch DistributedDataParallel (gloo, the same 25 MB buckets), DistributedSampler with the
same seed, the same GPT, AdamW, schedule, clipping and seed, and the same threads per rank
(cores // ranks).

The estimator is overhead.py's (_turns.py): the two jobs train at once and take turns step
by step, each Loom rank with the plain rank of its number; wall time per step is rank 0's,
CPU time per step the sum over the ranks. Legs, `--prices` and `--slow-*` as in overhead.py;
`--estimator difference`: the former runs of N and 2N steps. Target (read, not asserted):
ratio <= 1.03 with the interval's upper end under 1.05.

    .venv/bin/python scripts/bench/ddp_parity.py [--model gpt_small] [--steps 30] [--repeats 4] [--monitors all]
"""

from __future__ import annotations

import argparse
import sys

from _bench import write_json
from overhead import add_common, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, steps=30, repeats=4)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    res = run("ddp_parity", args, ["strategy=ddp", "hardware=cpu", f"hardware.devices={args.ranks}"], args.ranks)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
