#!/usr/bin/env python
"""Start-up costs: command to first optimizer step, and command to a validation error.

Interleaved per repeat, medians over the repeats (default 5):
- `python -c "import torch"`: the floor any PyTorch program pays (and, for reference,
  `python -c "import pytorch_lightning"`);
- `loom train model=nope`: time until the command exits with its one-paragraph
  validation error (exit 2), target <= 1 s;
- `loom train ... trainer.log_every_n_steps=1` for one process (strategy=single) and for the
  default 2-rank DDP job: time from starting the command to the moment its console prints
  the "training loop started" line and the "step 1/..." line. Rank 0 logs "step 1" right after
  the first optimizer step completes (Loom's Recorder, on_train_batch_end of step 1), and its
  console handler flushes each record (workers run with PYTHONUNBUFFERED=1), so the harness
  timestamps the line as it arrives on the pipe: that is the precise marker, on the
  harness's own monotonic clock. The plain-PyTorch side of the same measurement is
  plain_gpt.py (`import torch` + model + first step), printed next to it;
- time to first step, 2 ranks: the `ddp2` job against a plain torchrun script that imports
  torch and Lightning, builds the same model and takes a DDP step (plain_gpt.py
  --import-lightning under `torchrun --standalone --nproc-per-node=2`), both timed to their
  "step 1/" line; the ratio of medians is the time-to-first-step figure (goal <= 1.15).

    .venv/bin/python scripts/bench/startup.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _bench import (
    LOOM_COMMON,
    PLAIN,
    PY,
    REPO,
    bench_env,
    cleanup,
    fresh_root,
    load,
    loom_config,
    median,
    plain_config,
    write_json,
)

FIRST_STEP = {
    "single": ["strategy=single", "hardware=cpu", "hardware.devices=1", "tracking=none"],
    "ddp2": ["strategy=ddp", "hardware=cpu", "hardware.devices=2", "tracking=offline"],
}


def timed(cmd: list[str], markers: dict[str, str], cwd) -> tuple[dict[str, float], int, str]:
    """Run `cmd`, timestamping the first stdout line containing each marker; returns
    ({marker name: seconds since start, "exit": ...}, exit code, output)."""
    out: dict[str, float] = {}
    lines: list[str] = []
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         env=bench_env(), cwd=cwd)
    assert p.stdout is not None
    for line in p.stdout:
        now = time.perf_counter() - t0
        lines.append(line)
        for name, text in markers.items():
            if name not in out and text in line:
                out[name] = now
    rc = p.wait()
    out["exit"] = time.perf_counter() - t0
    return out, rc, "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--jobs", default="single,ddp2", help="first-step jobs: single, ddp2")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    root = fresh_root("startup")
    res: dict[str, list[float]] = {}
    plain_json = plain_config(loom_config(["strategy=single", f"model={args.model}", "trainer.log_every_n_steps=1"]))

    def add(key: str, v: float | None) -> None:
        res.setdefault(key, [])
        if v is not None:
            res[key].append(v)

    print(f"[startup] {args.repeats} repeats, interleaved; load {load()}", flush=True)
    try:
        for i in range(args.repeats):
            t, rc, _ = timed([PY, "-c", "import torch"], {}, REPO)
            add("import_torch_s", t["exit"])
            t, rc, _ = timed([PY, "-c", "import pytorch_lightning"], {}, REPO)
            add("import_lightning_s", t["exit"])
            t, rc, text = timed([PY, "-m", "loom.cli", "train", "model=nope"], {}, REPO)
            if rc != 2 or "model" not in text:
                print(f"  unexpected: loom train model=nope exited {rc}:\n{text[-2000:]}")
            add("validation_error_s", t["exit"])
            t, rc, text = timed([PY, str(PLAIN), "--config", plain_json, "--steps", "1"], {}, REPO)
            add("plain_first_step_exit_s", t["exit"])
            if "ddp2" in jobs:
                t2, rc, text = timed([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                      str(PLAIN), "--config", plain_json, "--steps", "2",
                                      "--import-lightning"], {"step1": "step 1/"}, REPO)
                if rc != 0 or "step1" not in t2:
                    print(f"  plain torchrun: exit {rc}, no 'step 1/' line:\n{text[-2000:]}")
                add("plain_ddp2_first_step_s", t2.get("step1"))
            line = f"  repeat {i}: import torch {res['import_torch_s'][-1]:.2f} s, import lightning " \
                   f"{res['import_lightning_s'][-1]:.2f} s, validation error {res['validation_error_s'][-1]:.2f} s " \
                   f"plain 1-step program {t['exit']:.2f} s"
            for job in jobs:
                cmd = [PY, "-m", "loom.cli", "train", *FIRST_STEP[job], f"model={args.model}",
                       "trainer.max_steps=2", "trainer.log_every_n_steps=1", *LOOM_COMMON,
                       f"run.root={root}", f"run.id=startup-{job}-{i}"]
                t, rc, text = timed(cmd, {"loop": "training loop started", "step1": "step 1/"}, root)
                if rc != 0 or "step1" not in t:
                    print(f"  {job}: exit {rc}, no 'step 1/' line:\n{text[-2000:]}")
                    continue
                add(f"{job}_loop_start_s", t.get("loop"))
                add(f"{job}_first_step_s", t["step1"])
                add(f"{job}_exit_s", t["exit"])
                line += f"; {job}: loop start {t.get('loop', float('nan')):.2f} s, first step {t['step1']:.2f} s"
            print(line, flush=True)
    finally:
        cleanup(root, args.keep)

    med = {k: median(v) for k, v in res.items()}
    print(f"[startup] medians of {args.repeats}:")
    print(f"  python -c 'import torch'             {med['import_torch_s']:.2f} s")
    print(f"  python -c 'import pytorch_lightning' {med['import_lightning_s']:.2f} s")
    print(f"  loom train model=nope -> exit 2      {med['validation_error_s']:.2f} s   (target <= 1 s)")
    print(f"  plain_gpt.py, 1 step, whole program  {med['plain_first_step_exit_s']:.2f} s")
    for job in jobs:
        if f"{job}_first_step_s" in med:
            print(f"  loom train ({job}) -> loop start {med[f'{job}_loop_start_s']:.2f} s, -> first optimizer step "
                  f"{med[f'{job}_first_step_s']:.2f} s ({med[f'{job}_first_step_s'] / med['import_torch_s']:.1f}x "
                  f"import torch)")
    ratio = None
    if "ddp2_first_step_s" in med and res.get("plain_ddp2_first_step_s"):
        ratio = med["ddp2_first_step_s"] / med["plain_ddp2_first_step_s"]
        print(f"  plain torchrun (torch + Lightning), 2 ranks -> first step {med['plain_ddp2_first_step_s']:.2f} s; "
              f"loom ddp2 / plain = {ratio:.2f}x (goal <= 1.15)")
    write_json(args.json, {"ddp2_first_step_ratio": ratio, "repeats": args.repeats, "model": args.model, "median_s": med, "runs_s": res,
                           "target": "validation_error_s <= 1.0"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
