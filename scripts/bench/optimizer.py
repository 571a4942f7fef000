#!/usr/bin/env python
"""AdamW step time by implementation, per device: what `optim.fused=auto` should pick.

torch's AdamW has three implementations: the per-tensor loop (foreach=False), foreach (torch's
own default where it applies) and fused (one kernel per dtype/device group). `optim.fused=auto`
(loom.optim.build.use_fused) takes fused wherever torch has a fused kernel for the device; this
measures whether that is the faster choice on this machine, for Loom's GPT parameter shapes,
with the thread counts a Loom rank uses (cores // ranks: 1 rank and 2 ranks per machine).

Each repeat steps every implementation once more (interleaved), with the same gradients;
medians over the repeats of the mean of `--steps` steps. Nothing is asserted.

    .venv/bin/python scripts/bench/optimizer.py [--models gpt_small,gpt_125m] [--repeats 7]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

from _bench import REPO, write_json


def _model(name: str):
    import yaml

    from loom.models.gpt.network import GPT

    cfg = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    return GPT(**{k: v for k, v in cfg.items() if k in inspect.signature(GPT).parameters})


def _time_steps(opt, steps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync()
    return (time.perf_counter() - t0) / steps


def measure(model_name: str, device: str, threads: int, steps: int, repeats: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    params = [p.to(device) for p in _model(model_name).parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kinds = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
    opts = {k: torch.optim.AdamW(params, lr=1e-4, **kw) for k, kw in kinds.items()}
    sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
    for opt in opts.values():  # state allocation and first-call costs out of the timing
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(repeats):
        for k, opt in opts.items():
            times[k].append(_time_steps(opt, steps, sync))
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt_small,gpt_125m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    setups = [("cpu", max(1, cores // 2)), ("cpu", cores)]
    if torch.cuda.is_available():
        setups.append(("cuda", cores))
    rows = []
    print(f"[optimizer] AdamW ms/step, median of {args.repeats} x {args.steps} steps (interleaved)")
    for model in [m for m in args.models.split(",") if m]:
        for device, threads in dict.fromkeys(setups):
            ms = measure(model, device, threads, args.steps, args.repeats)
            best = min(ms, key=ms.get)
            rows.append({"model": model, "device": device, "threads": threads, "ms": ms, "fastest": best})
            print(f"  {model:9s} {device:4s} {threads} thread(s): loop {ms['loop']:8.2f}  foreach "
                  f"{ms['foreach']:8.2f}  fused {ms['fused']:8.2f}  -> fastest {best} "
                  f"(fused / foreach = {ms['fused'] / ms['foreach']:.2f})", flush=True)
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "platform"))
    sys.exit(main())
