#!/usr/bin/env python
"""Per-rank memory of ddp, fsdp, zero1, zero2 and zero3 at 2 ranks, as ratios to ddp, in fp32
and in bf16-mixed (one column group per precision).

Runs `loom train strategy=S hardware=cpu hardware.devices=2 hardware.precision=P` for each
strategy and precision on a model whose states dominate (default gpt_125m, ~86M parameters,
with a tiny batch and sequence and a few steps) and reads, per rank:
- parameter and optimizer-state bytes *counted from the tensors each rank holds*
  (summary.json memory.param_bytes_per_rank / optim_state_bytes_per_rank: local shards of
  DTensors under FSDP2, `ds_tensor` partitions under ZeRO-3, DeepSpeed's fp32 master
  partition plus Adam m and v under ZeRO, BF16_Optimizer's at ZeRO-1 in bf16);
- gradient bytes *from the plan* (plan.json memory_per_device_bytes.grads): gradients are
  freed before the summary is written, so they are not counted;
- peak RSS (whole process: the torch/DeepSpeed runtime and activations included).

The ratio of param+grad+optim bytes to ddp's (at the same precision) is printed next to the
ZeRO paper's (mixed-precision Adam: 2/2/12 bytes per parameter; ddp 16, stage 1 4 + 12/N,
stage 2 2 + 14/N, stage 3 16/N) and the plan's for that precision (`loom.plan.memory`; fp32:
DeepSpeed keeps an fp32 master copy even when the model is fp32, 4/4/12 = 20 bytes per
parameter against 4/4/8 = 16 for ddp and FSDP; bf16-mixed: ddp/fsdp 4/4/8 (autocast keeps fp32
weights; FSDP2 keeps fp32 shards), zero* 2/2/12).
Targets in bf16-mixed (read, not asserted): zero3/fsdp <= 0.55, zero2 <= 0.70, zero1 <= 0.80.

    .venv/bin/python scripts/bench/memory.py [--model gpt_125m] [--strategies ddp,fsdp,zero1,zero2,zero3]
        [--precisions 32-true,bf16-mixed]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from _bench import LOOM_COMMON, Failed, cleanup, fresh_root, load, run_loom, write_json

TARGETS = {"fsdp": 0.55, "zero3": 0.55, "zero2": 0.70, "zero1": 0.80}  # bf16-mixed, 2 ranks
TARGET_PRECISION = "bf16-mixed"
SHORT = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16t", "16-mixed": "fp16"}


def theory(strategy: str, n: int, params: float, precision: str) -> dict[str, float]:
    """Bytes per rank: the ZeRO paper's mixed-precision split and Loom's plan at this precision."""
    from loom.plan.memory import per_param_bytes, state_bytes

    mixed = state_bytes(strategy, params, n, True)
    plan = state_bytes(strategy, params, n, precision != "32-true", per_param=per_param_bytes(strategy, precision))
    fp32 = state_bytes(strategy, params, n, False, per_param=per_param_bytes(strategy, "32-true"))
    return {"paper_mixed": mixed.states, "plan_states": plan.states, "plan_fp32": fp32.states}


def measure(args: argparse.Namespace, strategy: str, precision: str, root: Path) -> dict:
    """One run: bytes per rank counted from tensors (params, optimizer), from the plan (grads)."""
    n = args.ranks
    overrides = [f"strategy={strategy}", "hardware=cpu", f"hardware.devices={n}",
                 f"hardware.precision={precision}", "tracking=none", f"model={args.model}",
                 f"dataset.batch_size={args.batch_size}", f"dataset.seq_len={args.seq_len}",
                 f"trainer.max_steps={args.steps}", "trainer.log_every_n_steps=1", *LOOM_COMMON, *args.overrides]
    try:
        summ = run_loom(overrides, root, f"mem-{strategy}-{SHORT.get(precision, precision)}")
    except Failed as e:
        print(f"  {strategy} {precision}: FAILED\n{e}", flush=True)
        return {"failed": str(e)[-2000:]}
    plan = json.loads((Path(summ["run_dir"]) / "plan.json").read_text())
    mem = summ["memory"]
    params, optim = max(mem["param_bytes_per_rank"]), max(mem["optim_state_bytes_per_rank"])
    grads = plan["memory_per_device_bytes"]["grads"]
    print(f"  {strategy:<6} {precision:<10} params {params / 1e6:8.1f} MB  grads(plan) {grads / 1e6:8.1f} MB  "
          f"optim {optim / 1e6:8.1f} MB  peak RSS {max(mem['peak_rss_gb_per_rank']):.2f} GB  "
          f"({summ['command_wall_s']:.0f} s)", flush=True)
    return {
        "param_bytes_per_rank": mem["param_bytes_per_rank"],
        "optim_state_bytes_per_rank": mem["optim_state_bytes_per_rank"],
        "grad_bytes_per_rank_from_plan": grads,
        "states_bytes": params + grads + optim,
        "plan_states_bytes": plan["memory_per_device_bytes"]["states"],
        "peak_rss_gb_per_rank": mem["peak_rss_gb_per_rank"],
        "memory": mem,  # all of summary.json's memory block (later columns read from it)
        "n_params": plan["params"],
        "wall_s": summ["command_wall_s"],
        **theory(strategy, args.ranks, plan["params"], precision),
    }


def add_ratios(rows: dict[str, dict]) -> bool:
    """Ratios to ddp at the same precision, in place; False when ddp has no numbers."""
    base = rows.get("ddp", {})
    if "states_bytes" not in base:
        return False
    for r in rows.values():
        if "states_bytes" in r:
            r["ratio"] = r["states_bytes"] / base["states_bytes"]
            r["paper_ratio"] = r["paper_mixed"] / base["paper_mixed"]
            r["plan_ratio"] = r["plan_states"] / base["plan_states"]
            r["plan_fp32_ratio"] = r["plan_fp32"] / base["plan_fp32"]
            r["rss_ratio"] = max(r["peak_rss_gb_per_rank"]) / max(base["peak_rss_gb_per_rank"])
    return True


# (header, width, value of one row at one precision -> text). Per-precision column groups; a
# new measured column (e.g. the build-time peak, memory.build_peak_rss_gb_per_rank) is one entry.
COLUMNS: list[tuple[str, int, Callable[[dict], str]]] = [
    ("GB/rank", 8, lambda r: f"{r['states_bytes'] / 1e9:.3f}"),
    ("ratio", 6, lambda r: f"{r['ratio']:.3f}"),
    ("plan", 6, lambda r: f"{r['plan_ratio']:.3f}"),
    ("RSS", 6, lambda r: f"{r['rss_ratio']:.3f}"),
    # GB of peak RSS when the model is built, sharded and initialized (before the optimizer)
    ("build", 6, lambda r: f"{max(r['memory'].get('build_peak_rss_gb_per_rank') or [0.0]):.2f}"),
]


def print_table(by_precision: dict[str, dict[str, dict]], strategies: list[str], n: int) -> None:
    precisions = list(by_precision)
    print(f"[memory] param+grad+optim bytes per rank and ratios to ddp at the same precision ({n} ranks; "
          "params and optim counted from tensors, grads from the plan; plan: loom.plan's ratio; RSS: peak "
          "RSS ratio):")
    head = f"  {'strategy':<8}"
    for p in precisions:
        head += " | " + " ".join(f"{SHORT.get(p, p) + ' ' + h:>{w + 5}}" for h, w, _ in COLUMNS)
    print(head + f" | {'paper(mixed)':>12} {'target(bf16)':>12}")
    for s in strategies:
        line, paper = f"  {s:<8}", "-"
        for p in precisions:
            r = by_precision[p].get(s, {})
            ok = "ratio" in r
            line += " | " + " ".join(f"{(fn(r) if ok else 'failed'):>{w + 5}}" for _, w, fn in COLUMNS)
            paper = f"{r['paper_ratio']:.3f}" if ok else paper
        tgt = TARGETS.get(s)
        mark = ""
        r = by_precision.get(TARGET_PRECISION, {}).get(s, {})
        if tgt and "ratio" in r:
            mark = " ok" if r["ratio"] <= tgt else " MISSED"
        print(line + f" | {paper:>12} {(f'<={tgt:.2f}' + mark) if tgt else '-':>12}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3")
    ap.add_argument("--precisions", default="32-true,bf16-mixed",
                    help="comma-separated hardware.precision values, one column group each")
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
    precisions = args.precisions.split(",")
    root = fresh_root("memory")
    print(f"[memory] model={args.model} at {args.ranks} ranks, batch {args.batch_size} x seq {args.seq_len}, "
          f"{args.steps} steps, precisions {', '.join(precisions)}; load {load()}", flush=True)
    by_precision: dict[str, dict[str, dict]] = {}
    try:
        for p in precisions:
            by_precision[p] = {s: measure(args, s, p, root) for s in strategies}
    finally:
        cleanup(root, args.keep)
    ok = all([add_ratios(rows) for rows in by_precision.values()])
    print_table(by_precision, strategies, args.ranks)
    # "rows": the precision the targets are for (what run_all.py tabulates); every precision's
    # rows under "by_precision".
    main_rows = by_precision.get(TARGET_PRECISION) or next(iter(by_precision.values()))
    for s, r in main_rows.items():
        r["target"] = TARGETS.get(s)
    write_json(args.json, {"model": args.model, "ranks": args.ranks, "target_precision": TARGET_PRECISION,
                           "rows": main_rows, "by_precision": by_precision})
    if not ok:
        print("[memory] ddp failed at some precision: no ratios there")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
