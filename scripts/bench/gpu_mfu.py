#!/usr/bin/env python
"""Tokens/s and MFU on one GPU, bf16, seq 2048: `loom train` vs a plain PyTorch loop, like for like.

For each model (default gpt_125m, gpt_1b and llama3_1b) four runs, one after another:
- loom eager:     `loom train strategy=single hardware.devices=1 tracking=csv` with hardware=auto
                  (a known device gets its shipped profile: datasheet peak, bf16-mixed),
                  dataset.seq_len=2048;
- loom compiled:  the same with trainer.compile=true (each block compiled, as Loom does);
- plain eager:    plain_gpt.py --device cuda --dtype bf16 (autocast bf16, as Lightning's
                  bf16-mixed), the same network class (GPT or Llama), data, optimizer and seed;
- plain compiled: the same with torch.compile(model).
Loom compiled is compared with plain compiled, Loom eager with plain eager.
With `--float8 RECIPE` (e.g. tensorwise) a fifth run, `loom float8 compiled`: the loom compiled run
with float8=RECIPE (torchao; the same model, batch and data), compared with bf16's loom compiled
(`loom float8 compiled / loom compiled` tokens/s). Its MFU here counts the same FLOPs against the
bf16 peak (so the two read on one scale); Loom's own `loom_mfu_reported` is against its float8 peak.
Steady-state rates only: Loom's last logged window (metrics.csv perf/tokens_per_sec, the
steps after `--warmup`; trainer.log_every_n_steps is set to steps - warmup so the window is
exactly those steps) and the plain loop timed over the same steps (CUDA-synchronized).
MFU = tokens/s x FLOPs per token / peak; FLOPs per token from loom.models.model_spec (6 N +
12 L d T, PaLM appendix B); the peak is the profile's datasheet bf16, else the package's table
(loom.hardware.peaks.lookup by device name and compute capability: an H200 NVL is not an
H200 SXM), else --peak-tflops. Target: gpt_1b MFU >= 45% on H100.

Without CUDA it prints why and exits 0 without running anything.

    .venv/bin/python scripts/bench/gpu_mfu.py --model gpt_1b --seq 2048
    .venv/bin/python scripts/bench/gpu_mfu.py                  # the three default models
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from _bench import (
    LOOM_COMMON,
    Failed,
    cleanup,
    fresh_root,
    loom_config,
    plain_config,
    run_loom,
    run_plain,
    write_json,
)

BATCH = {"gpt_125m": 16, "gpt_1b": 8, "llama3_1b": 4, "gpt_7b": 1}
DEFAULT_MODELS = ("gpt_125m", "gpt_1b", "llama3_1b")
PAIRS = (("loom eager", "plain eager"), ("loom compiled", "plain compiled"))
FLOAT8_SIDE = "loom float8 compiled"  # --float8: compared with bf16's "loom compiled"


def flops_per_token(cfg: dict) -> float:
    from omegaconf import OmegaConf

    from loom.models import model_spec

    return float(model_spec(OmegaConf.create(cfg)).flops_per_token)


def device_peak(name: str, cc: tuple[int, int]) -> float | None:
    """The package's datasheet bf16 peak of this device (exact names, checked against its
    compute capability), or None."""
    from loom.hardware.peaks import lookup

    row = lookup(name, cc)
    return row.bf16 if row else None


def last_row(metrics: Path) -> dict[str, str]:
    with open(metrics, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/tokens_per_sec")]
    return rows[-1] if rows else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=f"one model (default: {', '.join(DEFAULT_MODELS)})")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, help="per-device micro batch (default: 16 for gpt_125m, 8 for gpt_1b)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the timed window (compile, allocator)")
    ap.add_argument("--peak-tflops", type=float, help="bf16 dense peak of this GPU (default: the profile's)")
    ap.add_argument("--no-compile", action="store_true", help="skip both compiled runs (Loom's and plain)")
    ap.add_argument("--float8", metavar="RECIPE", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"),
                    help="also run Loom compiled with float8=RECIPE and compare it with bf16's loom compiled")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_mfu.py: skipped: no CUDA device visible to torch {torch.__version__} "
              f"(CUDA build: {torch.version.cuda or 'none, a CPU-only build'}). It needs one NVIDIA GPU "
              "(the MFU target is for an H100); nothing was run.")
        return 0
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")
    name = torch.cuda.get_device_name(0)
    models = [args.model] if args.model else list(DEFAULT_MODELS)
    table_peak = device_peak(name, torch.cuda.get_device_capability(0))
    window = args.steps - args.warmup
    root = fresh_root("gpu-mfu")
    out: dict[str, dict] = {}
    print(f"[gpu_mfu] {name}, torch {torch.__version__}; seq {args.seq}, bf16, {args.steps} steps, "
          f"timed over the last {window}", flush=True)
    try:
        for model in models:
            batch = args.batch_size or BATCH.get(model, 8)
            overrides = ["strategy=single", "hardware.devices=1", "tracking=csv", f"model={model}",
                         f"dataset.seq_len={args.seq}", f"dataset.batch_size={batch}",
                         "hardware.precision=bf16-mixed", f"trainer.log_every_n_steps={window}"]
            if args.peak_tflops:
                overrides.append(f"hardware.peak_tflops.bf16={args.peak_tflops}")
            cfg = loom_config([*overrides, f"trainer.max_steps={args.steps}"])
            peak_tflops = args.peak_tflops or (cfg["hardware"].get("peak_tflops") or {}).get("bf16") or table_peak
            fpt = flops_per_token(cfg)
            tokens_per_step = batch * args.seq
            res: dict[str, dict] = {}

            def record(side: str, tok_s: float | None, extra: dict, res=res, model=model, fpt=fpt,
                       peak=peak_tflops) -> None:
                tflops = tok_s * fpt / 1e12 if tok_s else None
                mfu = tflops / peak if tflops and peak else None
                res[side] = {"tokens_per_sec": tok_s, "tflops": tflops, "mfu": mfu, **extra}
                print(f"  {model:<9} {side:<15} {tok_s or 0:12,.0f} tok/s  {tflops or 0:7.1f} TFLOP/s  "
                      f"MFU {'%.1f%%' % (100 * mfu) if mfu is not None else 'n/a'}", flush=True)

            compiled = [False] if args.no_compile else [False, True]
            loom_runs = [(c, "loom compiled" if c else "loom eager", []) for c in compiled]
            if args.float8:  # the float8 pair: bf16's loom compiled vs the same run in float8
                loom_runs.append((not args.no_compile, FLOAT8_SIDE, [f"float8={args.float8}"]))
            for compile_, side, more in loom_runs:
                try:
                    s = run_loom([*overrides, *LOOM_COMMON, f"trainer.max_steps={args.steps}",
                                  f"trainer.compile={str(compile_).lower()}", *more], root,
                                 f"mfu-{model}-{'compiled' if compile_ else 'eager'}{'-float8' if more else ''}",
                                 timeout=1800)
                    row = last_row(Path(s["run_dir"]) / "metrics.csv")
                    mem = s["memory"]
                    record(side, float(row["perf/tokens_per_sec"]) if row else None,
                           {"loom_mfu_reported": float(row["perf/mfu"]) if row.get("perf/mfu") else None,
                            "summary_tokens_per_sec": s["throughput"]["tokens_per_sec"],
                            "peak_gpu_mem_gb": (mem.get("peak_gpu_mem_gb_per_rank") or [None])[0],
                            "peak_gpu_reserved_gb": (mem.get("peak_gpu_reserved_gb_per_rank") or [None])[0],
                            "final_loss": s.get("final_loss"), **({"float8": s.get("float8")} if more else {})})
                except Failed as e:
                    print(f"  {model} {side}: FAILED\n{e}", flush=True)
            config_json = plain_config(cfg)
            for compile_ in compiled:
                side = "plain compiled" if compile_ else "plain eager"
                try:
                    p = run_plain(config_json, args.steps, 1, ["--device", "cuda", "--dtype", "bf16",
                                                               "--warmup-steps", str(args.warmup),
                                                               *(["--compile"] if compile_ else [])],
                                  timeout=1800)
                    record(side, p["timed_steps"] * tokens_per_step / p["timed_time_s"],
                           {"peak_gpu_mem_gb": p["peak_gpu_mem_gb"], "final_loss": p["final_loss"]})
                except Failed as e:
                    print(f"  {model} {side}: FAILED\n{e}", flush=True)
            ratios = {}
            pairs = [*PAIRS, (FLOAT8_SIDE, "loom compiled" if not args.no_compile else "loom eager")] \
                if args.float8 else PAIRS
            for loom_side, plain_side in pairs:
                a, b = (res.get(k, {}).get("tokens_per_sec") for k in (loom_side, plain_side))
                if a and b:
                    ratios[f"{loom_side} / {plain_side}"] = a / b
                    print(f"  {model}: {loom_side} / {plain_side} tokens/s = {a / b:.3f}", flush=True)
            out[model] = {"batch_size": batch, "seq_len": args.seq, "flops_per_token": fpt,
                          "peak_tflops": peak_tflops, "sides": res, "ratios": ratios}
    finally:
        cleanup(root, args.keep)
    if "gpt_1b" in out:
        sides = out["gpt_1b"]["sides"]
        m = max((sides.get(k) or {}).get("mfu") or 0.0 for k in ("loom eager", "loom compiled")) or None
        print(f"[gpu_mfu] gpt_1b loom MFU {'%.1f%%' % (100 * m) if m is not None else 'n/a'} (target >= 45% on H100)")
    write_json(Path(args.json) if args.json else None,
               {"device": name, "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
                "table_peak_tflops": table_peak, "models": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
