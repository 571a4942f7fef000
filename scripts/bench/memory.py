#!/usr/bin/env python
"""Per-rank memory of ddp, fsdp, zero1, zero2 and zero3 at 2 ranks, as ratios to ddp.

Runs `loom train strategy=S hardware=cpu hardware.devices=2` for each strategy on a model
whose states dominate (default gpt_125m, ~86M parameters, with a tiny batch and sequence and
a few steps) and reads, per rank:
- parameter and optimizer-state bytes *counted from the tensors each rank holds*
  (summary.json memory.param_bytes_per_rank / optim_state_bytes_per_rank: local shards of
  DTensors under FSDP2, `ds_tensor` partitions under ZeRO-3, DeepSpeed's fp32 master
  partition plus Adam m and v under ZeRO);
- gradient bytes *from the plan* (plan.json memory_per_device_bytes.grads): gradients are
  freed before the summary is written, so they are not counted;
- peak RSS (whole process: the torch/DeepSpeed runtime and activations included).

The ratio of param+grad+optim bytes to ddp's is printed next to two theoretical ratios:
the ZeRO paper's (mixed-precision Adam: 2/2/12 bytes per parameter; ddp 16, stage 1
4 + 12/N, stage 2 2 + 14/N, stage 3 16/N) and the fp32 one `loom.plan.memory.state_bytes` gives
for this CPU run (DeepSpeed keeps an fp32 master copy even when the model is fp32:
4/4/12 = 20 bytes per parameter, against 4/4/8 = 16 for ddp and FSDP).
Targets (read, not asserted): zero3/fsdp <= 0.55, zero2 <= 0.70, zero1 <= 0.80.

    .venv/bin/python scripts/bench/memory.py [--model gpt_125m] [--strategies ddp,fsdp,zero1,zero2,zero3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _bench import LOOM_COMMON, Failed, cleanup, fresh_root, load, run_loom, write_json

TARGETS = {"fsdp": 0.55, "zero3": 0.55, "zero2": 0.70, "zero1": 0.80}


def theory(strategy: str, n: int, params: float) -> dict[str, float]:
    """Bytes per rank: the ZeRO paper's mixed-precision split and Loom's fp32 plan."""
    from loom.plan.memory import per_param_bytes, state_bytes

    mixed = state_bytes(strategy, params, n, True)
    fp32 = state_bytes(strategy, params, n, False, per_param=per_param_bytes(strategy, "32-true"))
    return {"paper_mixed": mixed.states, "plan_fp32": fp32.states}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    strategies = args.strategies.split(",")
    if "ddp" not in strategies:
        strategies.insert(0, "ddp")
    n = args.ranks
    root = fresh_root("memory")
    print(f"[memory] model={args.model} at {n} ranks, batch {args.batch_size} x seq {args.seq_len}, "
          f"{args.steps} steps; load {load()}", flush=True)
    rows: dict[str, dict] = {}
    try:
        for s in strategies:
            overrides = [f"strategy={s}", "hardware=cpu", f"hardware.devices={n}", "tracking=none",
                         f"model={args.model}", f"dataset.batch_size={args.batch_size}",
                         f"dataset.seq_len={args.seq_len}", f"trainer.max_steps={args.steps}",
                         "trainer.log_every_n_steps=1", *LOOM_COMMON, *args.overrides]
            try:
                summ = run_loom(overrides, root, f"mem-{s}")
            except Failed as e:
                print(f"  {s}: FAILED\n{e}", flush=True)
                rows[s] = {"failed": str(e)[-2000:]}
                continue
            plan = json.loads((Path(summ["run_dir"]) / "plan.json").read_text())
            mem = summ["memory"]
            params = max(mem["param_bytes_per_rank"])
            optim = max(mem["optim_state_bytes_per_rank"])
            grads = plan["memory_per_device_bytes"]["grads"]
            rows[s] = {
                "param_bytes_per_rank": mem["param_bytes_per_rank"],
                "optim_state_bytes_per_rank": mem["optim_state_bytes_per_rank"],
                "grad_bytes_per_rank_from_plan": grads,
                "states_bytes": params + grads + optim,
                "plan_states_bytes": plan["memory_per_device_bytes"]["states"],
                "peak_rss_gb_per_rank": mem["peak_rss_gb_per_rank"],
                "n_params": plan["params"],
                "wall_s": summ["command_wall_s"],
                **theory(s, n, plan["params"]),
            }
            print(f"  {s:<6} params {params / 1e6:8.1f} MB  grads(plan) {grads / 1e6:8.1f} MB  "
                  f"optim {optim / 1e6:8.1f} MB  peak RSS {max(mem['peak_rss_gb_per_rank']):.2f} GB  "
                  f"({summ['command_wall_s']:.0f} s)", flush=True)
    finally:
        cleanup(root, args.keep)

    base = rows.get("ddp", {})
    if "states_bytes" not in base:
        print("[memory] ddp failed: no ratios")
        write_json(args.json, {"rows": rows})
        return 1
    print(f"[memory] param+grad+optim bytes per rank as a ratio to ddp ({n} ranks; params and optim "
          "counted from tensors, grads from the plan):")
    print(f"  {'strategy':<8} {'GB/rank':>8} {'ratio':>6} {'paper(mixed)':>12} {'plan(fp32)':>10} "
          f"{'target':>7} {'peak RSS ratio':>14}")
    for s, r in rows.items():
        if "states_bytes" not in r:
            print(f"  {s:<8} failed")
            continue
        r["ratio"] = r["states_bytes"] / base["states_bytes"]
        r["paper_ratio"] = r["paper_mixed"] / base["paper_mixed"]
        r["plan_fp32_ratio"] = r["plan_fp32"] / base["plan_fp32"]
        r["rss_ratio"] = max(r["peak_rss_gb_per_rank"]) / max(base["peak_rss_gb_per_rank"])
        r["target"] = TARGETS.get(s)
        tgt = f"<={r['target']:.2f}" if r["target"] else "-"
        print(f"  {s:<8} {r['states_bytes'] / 1e9:8.3f} {r['ratio']:6.3f} {r['paper_ratio']:12.3f} "
              f"{r['plan_fp32_ratio']:10.3f} {tgt:>7} {r['rss_ratio']:14.3f}")
    write_json(args.json, {"model": args.model, "ranks": n, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
