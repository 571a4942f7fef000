#!/usr/bin/env python
"""A transformers Llama (`model=hf_causal_lm`) against Loom's own Llama family (`model=llama`) of the
same shape and weights, both under `strategy=fsdp`: is the native family still the fast path,
and where does any difference go?

Makes one LlamaForCausalLM checkpoint (random weights, `save_pretrained`), trains it with both
options in turns (`--repeats` pairs, alternating which goes first), and compares the median
`perf/step_time_ms` after `--warmup` steps. When the two differ by more than 10%, it says where
from a profile, not a guess: one more run of each with Loom's `trainer.profile` over
`--profile-steps` steps, rank 0's step split (compute, communication, data wait) and operators
by self time side by side, largest difference first. Nothing asserts a time; the figures go to docs/benchmarks.md.

    .venv/bin/python scripts/bench/hf_vs_native.py                       # 4 layers, h 256, seq 128, 2 ranks
    .venv/bin/python scripts/bench/hf_vs_native.py --layers 8 --hidden 512 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

from _bench import Failed, cleanup, fresh_root, run_loom, write_json

THRESHOLD = 1.10  # a difference beyond this is explained by the profile


def make_checkpoint(path: Path, layers: int, hidden: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 32 * 32,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def step_ms(run_dir: Path, warmup: int) -> float:
    with open(Path(run_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/step_time_ms") and int(r["step"]) > warmup]
    return statistics.median(float(r["perf/step_time_ms"]) for r in rows)


def profiled(common: list[str], options: dict[str, list[str]], root: Path, warmup: int,
             steps: int) -> dict[str, dict]:
    """Each option's rank-0 profile of `steps` steps after `warmup` (Loom's own `trainer.profile`:
    <run>/profile/summary.json, the top operators by self time and the step's split)."""
    import json

    out = {}
    for name, opts in options.items():
        s = run_loom([*common, *opts, f"trainer.profile.steps=[{warmup + 1},{warmup + 1 + steps}]"], root,
                     f"{name}-profile")
        out[name] = json.loads((Path(s["run_dir"]) / "profile" / "summary.json").read_text())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="global batch (2 ranks)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    root = fresh_root("hf-vs-native")
    source = make_checkpoint(root / "tiny-llama", args.layers, args.hidden, args.vocab)
    common = ["hardware=cpu", "hardware.devices=2", "strategy=fsdp", "dataset=synthetic",
              f"dataset.vocab_size={args.vocab}", f"dataset.seq_len={args.seq}", f"dataset.batch_size={args.batch // 2}",
              f"trainer.max_steps={args.steps}", "trainer.val_every_n_steps=0", "tracking=csv",
              "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=0"]
    options = {"native": ["model=llama", f"model.init_from={source}"],
               "hf": ["model=hf_causal_lm", f"model.config={source}"]}
    times: dict[str, list[float]] = {"native": [], "hf": []}
    try:
        for r in range(args.repeats):
            for name in (("native", "hf") if r % 2 == 0 else ("hf", "native")):
                s = run_loom([*common, *options[name]], root, f"{name}-{r}")
                times[name].append(step_ms(Path(s["run_dir"]), args.warmup))
                print(f"repeat {r} {name:6s} {times[name][-1]:8.1f} ms/step", flush=True)
    except Failed as e:
        print(e, file=sys.stderr)
        return 1
    native, hf = statistics.median(times["native"]), statistics.median(times["hf"])
    ratio = hf / native
    print(f"\nfsdp, 2 ranks, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, global batch {args.batch}: "
          f"native {native:.1f} ms/step, hf {hf:.1f} ms/step, hf/native {ratio:.3f}")
    result = {"native_ms": native, "hf_ms": hf, "ratio": ratio, "times": times, "args": vars(args) | {"json": None}}
    if abs(ratio - 1) > THRESHOLD - 1:
        prof = profiled(common, options, root, args.warmup, args.profile_steps)
        n = {name: len(p["steps"]) or 1 for name, p in prof.items()}
        print(f"\nbeyond {THRESHOLD - 1:.0%}: where it goes (rank 0's profile of {args.profile_steps} fsdp steps, "
              "ms per step):")
        for part in ("step", "compute", "communication", "data_wait"):
            a, b = (prof[k]["time_ms"][part] / n[k] for k in ("native", "hf"))
            print(f"{part:40s} {a:9.2f} {b:9.2f} {b - a:+10.2f}")
        ops = {k: {o["name"]: o["self_ms"] / n[k] for o in p["top_ops"]} for k, p in prof.items()}
        keys = set(ops["native"]) | set(ops["hf"])
        diff = sorted(keys, key=lambda k: -abs(ops["hf"].get(k, 0) - ops["native"].get(k, 0)))[:15]
        print(f"{'operator (self time)':40s} {'native':>9s} {'hf':>9s} {'hf-native':>10s}")
        for k in diff:
            a, b = ops["native"].get(k, 0.0), ops["hf"].get(k, 0.0)
            print(f"{k[:40]:40s} {a:9.2f} {b:9.2f} {b - a:+10.2f}")
        result["profile"] = {k: {"time_ms": p["time_ms"], "steps": p["steps"], "top_ops": p["top_ops"]}
                             for k, p in prof.items()}
    write_json(args.json, result)
    cleanup(root, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
