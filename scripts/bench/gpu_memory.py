#!/usr/bin/env python
"""Peak GPU memory of gpt_1b on one GPU under single, fsdp and zero3, against `loom plan`.

For each strategy: `loom train model=gpt_1b strategy=S hardware=auto hardware.devices=1`
(a known H100/H200 gets its shipped profile: bf16-mixed, datasheet memory) for a few steps,
then summary.json `memory.peak_gpu_mem_gb_per_rank` (torch.cuda.max_memory_allocated) next
to plan.json's `memory_per_device_bytes.total` (weights, optimizer, gradients and activations:
summed, or the larger of the last two where the gradients are freed first) and the build-time
peak RSS. Goal (issue 14): the plan within 15% of the measured peak.

Without CUDA it prints why and exits 0 without running anything.

    .venv/bin/python scripts/bench/gpu_memory.py [--model gpt_1b] [--strategies single,fsdp,zero3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _bench import LOOM_COMMON, Failed, cleanup, fresh_root, run_loom, write_json

GOAL = 0.15


def cuda_device() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def measure(strategy: str, args: argparse.Namespace, root: Path) -> dict:
    overrides = [f"strategy={strategy}", "hardware=auto", "hardware.devices=1", f"model={args.model}",
                 f"dataset.batch_size={args.batch_size}", f"dataset.seq_len={args.seq_len}",
                 f"trainer.max_steps={args.steps}", "tracking=csv", *LOOM_COMMON, *args.overrides]
    summ = run_loom(overrides, root, f"gpumem-{strategy}")
    plan = json.loads((Path(summ["run_dir"]) / "plan.json").read_text())
    measured = max(summ["memory"]["peak_gpu_mem_gb_per_rank"] or [0.0]) * 2**30
    estimate = plan["memory_per_device_bytes"]["total"]
    return {"measured_bytes": measured, "plan_bytes": estimate,
            "plan_error": (estimate - measured) / measured if measured else None,
            "build_peak_rss_gb": max(summ["memory"]["build_peak_rss_gb_per_rank"] or [0.0]),
            "tokens_per_sec": (summ.get("throughput") or {}).get("tokens_per_sec")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_1b")
    ap.add_argument("--strategies", default="single,fsdp,zero3")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    device = cuda_device()
    if device is None:
        print("gpu_memory.py: skipped: no CUDA device visible (torch.cuda.is_available() is False)")
        return 0
    root = fresh_root("gpumem")
    rows: dict[str, dict] = {}
    print(f"[gpu_memory] {args.model} on one {device}, batch {args.batch_size} x seq {args.seq_len}", flush=True)
    try:
        for s in args.strategies.split(","):
            try:
                rows[s] = measure(s, args, root)
            except Failed as e:
                rows[s] = {"failed": str(e)[-2000:]}
                print(f"  {s}: FAILED\n{e}", flush=True)
                continue
            r = rows[s]
            ok = r["plan_error"] is not None and abs(r["plan_error"]) <= GOAL
            print(f"  {s:<7} measured {r['measured_bytes'] / 2**30:7.2f} GiB  plan {r['plan_bytes'] / 2**30:7.2f} GiB"
                  f"  error {r['plan_error']:+.1%} {'ok' if ok else 'MISSED'}  build RSS "
                  f"{r['build_peak_rss_gb']:.2f} GiB  {r['tokens_per_sec'] or 0:,.0f} tok/s", flush=True)
    finally:
        cleanup(root, args.keep)
    write_json(args.json, {"model": args.model, "device": device, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
