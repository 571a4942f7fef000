#!/usr/bin/env python
"""Every CPU benchmark of scripts/bench/, then one table of ratios against their targets.

Runs, each as its own process (a failure is recorded and the rest go on):
  overhead.py    loom train (1 process) vs a plain PyTorch loop: per-step ratio, final losses
  ddp_parity.py  loom train strategy=ddp (2 ranks) vs plain torchrun + torch DDP
  memory.py      param+grad+optim bytes per rank of fsdp/zero1/zero2/zero3 as ratios to ddp
  startup.py     command to first optimizer step; command to a validation error
  tracking.py    tracking=offline vs tracking=none, per-step (written with loom.tracking)
and writes bench-results.json (gitignored) in the repository root: the table, every
benchmark's own JSON, the machine, the load average and the versions. Nothing asserts a
time: the table says which targets the figures meet. gpu_mfu.py needs CUDA and is not run
here (its row says so).

    .venv/bin/python scripts/bench/run_all.py            # the full set (~12-15 min on 2 cores)
    .venv/bin/python scripts/bench/run_all.py --quick    # fewer steps and repeats (~6 min)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import PY, REPO, bench_env, load

HERE = Path(__file__).resolve().parent

# (name, script, args full, args quick)
BENCHES = [
    ("overhead", "overhead.py", ["--model", "gpt_small", "--steps", "40", "--repeats", "4"],
     ["--model", "gpt_small", "--steps", "25", "--repeats", "2"]),
    ("ddp_parity", "ddp_parity.py", ["--model", "gpt_small", "--steps", "30", "--repeats", "4"],
     ["--model", "gpt_small", "--steps", "20", "--repeats", "2"]),
    ("memory", "memory.py", ["--model", "gpt_125m"], ["--model", "gpt_125m"]),
    ("startup", "startup.py", ["--repeats", "5", "--jobs", "single,ddp2"],
     ["--repeats", "5", "--jobs", "single"]),
    ("tracking", "tracking.py", ["--repeats", "3", "--steps", "40"], ["--repeats", "2", "--steps", "30"]),
]


def versions() -> dict[str, str | None]:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for p in ('torch', 'pytorch-lightning', 'deepspeed', 'hydra-core', 'wandb'):\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = None\n"
            "print(json.dumps(out))")
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    return json.loads(p.stdout) if p.returncode == 0 else {}


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "memory_gb": mem_gb, "python": platform.python_version(),
            "os": platform.platform()}


def run_bench(name: str, script: str, args: list[str], out: Path) -> tuple[dict | None, float, str | None]:
    path = HERE / script
    if not path.exists():
        return None, 0.0, f"{script} not found"
    t0 = time.perf_counter()
    print(f"\n=== {name}: {script} {' '.join(args)}", flush=True)
    p = subprocess.run([PY, str(path), *args, "--json", str(out)], env=bench_env(), cwd=REPO)
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not out.exists():
        return None, wall, f"exit {p.returncode}"
    return json.loads(out.read_text()), wall, None


def fmt_ok(value: float | None, limit: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value <= limit else f"MISSED by {value / limit - 1:+.0%}"


def _per_step_rows(name: str, what: str, r: dict | None) -> list[tuple[str, str, str, str]]:
    """The in-turns estimator's rows (scripts/bench/_turns.py): the paired steps' wall ratio
    with its 95% interval against the target, the median, log-window and CPU ratios, the losses."""
    if not r:
        return [(name, "failed", "<= 1.03", "n/a")]

    def shown(m: str) -> str:
        q = r["ratio"][m]
        return f"{q['value']:.3f} [{q['low']:.3f}, {q['high']:.3f}]"

    q = r["ratio"]["wall_paired"]
    ok = q["value"] <= 1.03 and q["high"] < 1.05
    return [
        (f"{name}: loom/plain per step, paired wall, {what}", shown("wall_paired"), "<= 1.03, high < 1.05",
         "met" if ok else f"MISSED ({q['value']:.3f}, high {q['high']:.3f})"),
        ("  same, median steps", shown("wall_median_ms"), "-", "info"),
        ("  same, per log window (log steps in)", shown("wall_window_ms"), "-", "info"),
        ("  same, CPU time per log window", shown("cpu_window_ms"), "-", "info"),
        ("  per-step ms loom / plain", f"{r['mean_ms']['a']['wall_median_ms']:.1f} / "
         f"{r['mean_ms']['b']['wall_median_ms']:.1f}", "-", "info"),
        ("  final loss loom / plain", f"{r['final_loss']['a']:.6f} / {r['final_loss']['b']:.6f}", "|diff| <= 1e-4",
         "match" if r["losses_match"] else "DIFFER"),
    ]


def table(results: dict[str, dict | None]) -> list[tuple[str, str, str, str]]:
    """Rows: (measure, value, target, verdict)."""
    rows: list[tuple[str, str, str, str]] = []
    for name, what in (("overhead", "1 proc"), ("ddp_parity", "2 ranks")):
        rows.extend(_per_step_rows(name, what, results.get(name)))
    m = results.get("memory")
    if m and "ddp" in m.get("rows", {}) and "ratio" in m["rows"]["ddp"]:
        for s in ("fsdp", "zero3", "zero2", "zero1"):
            r = m["rows"].get(s)
            if not r or "ratio" not in r:
                rows.append((f"memory {s}/ddp states per rank", "failed", "-", "n/a"))
                continue
            rows.append((f"memory {s}/ddp param+grad+optim per rank", f"{r['ratio']:.3f}",
                         f"<= {r['target']:.2f}", fmt_ok(r["ratio"], r["target"])
                         + f" (fp32 theory {r['plan_fp32_ratio']:.3f}, paper mixed {r['paper_ratio']:.3f})"))
    else:
        rows.append(("memory", "failed", "-", "n/a"))
    s = results.get("startup")
    if s:
        med = s["median_s"]
        rows.append(("startup: loom train model=nope -> exit 2 (s)", f"{med['validation_error_s']:.2f}",
                     "<= 1 s", fmt_ok(med["validation_error_s"], 1.0)))
        rows.append(("  python -c 'import torch' (s)", f"{med['import_torch_s']:.2f}", "-", "info"))
        for job in ("single", "ddp2"):
            if f"{job}_first_step_s" in med:
                rows.append((f"  loom train ({job}) -> first optimizer step (s)",
                             f"{med[f'{job}_first_step_s']:.2f}", "-", "info"))
        rows.append(("  plain_gpt.py 1 step, whole program (s)", f"{med['plain_first_step_exit_s']:.2f}", "-", "info"))
    else:
        rows.append(("startup", "failed", "<= 1 s", "n/a"))
    t = results.get("tracking")
    if t:
        r = t["ratio_offline_over_none"]
        rows.append(("tracking: offline/none per-step", f"{r:.3f}", "<= 1.01", fmt_ok(r, 1.01)))
    else:
        rows.append(("tracking", "failed", "<= 1.01", "n/a"))
    rows.append(("gpu_mfu: gpt_1b bf16 MFU on one H100", "not run (no CUDA here)", ">= 45%",
                 "see gpu_mfu.py / docs/benchmarks.md"))
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    head = ("measure", "value", "target", "verdict")
    w = [max(a, len(b)) for a, b in zip(w, head, strict=True)]
    lines = ["  ".join(h.ljust(x) for h, x in zip(head, w, strict=True)),
             "  ".join("-" * x for x in w)]
    lines += ["  ".join(c.ljust(x) for c, x in zip(r, w, strict=True)) for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--only", help="comma-separated subset: " + ",".join(b[0] for b in BENCHES))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results.json")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    started = dt.datetime.now().astimezone()
    t0 = time.perf_counter()
    load_before = load()
    print(f"run_all {'--quick ' if args.quick else ''}started {started:%Y-%m-%d %H:%M %Z}; load {load_before}",
          flush=True)
    results: dict[str, dict | None] = {}
    walls: dict[str, float] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="loom-bench-all-") as tmp:
        for name, script, full, quick in BENCHES:
            if only and name not in only:
                continue
            res, wall, err = run_bench(name, script, quick if args.quick else full, Path(tmp) / f"{name}.json")
            results[name], walls[name] = res, wall
            if err:
                errors[name] = err
                print(f"=== {name}: FAILED ({err})", flush=True)
            else:
                print(f"=== {name}: {wall:.0f} s", flush=True)
    total = time.perf_counter() - t0
    print(f"\nLoom benchmarks vs plain PyTorch ({'quick' if args.quick else 'full'} run, {total / 60:.1f} min, "
          f"load before {load_before}, after {load()}):")
    rows = table(results)
    text = print_table(rows)
    data = {
        "started": started.isoformat(timespec="seconds"),
        "quick": args.quick,
        "total_wall_s": round(total, 1),
        "wall_s": {k: round(v, 1) for k, v in walls.items()},
        "load_before": load_before,
        "load_after": load(),
        "machine": machine(),
        "versions": versions(),
        "command": " ".join([".venv/bin/python", "scripts/bench/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
        "table": [dict(zip(("measure", "value", "target", "verdict"), r, strict=True)) for r in rows],
        "table_text": text,
        "errors": errors,
        "results": results,
    }
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"results: {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
