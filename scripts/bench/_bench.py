"""Shared helpers of the benchmarks in scripts/bench/ (not a benchmark itself).

Each benchmark runs its two sides interleaved (A B A B ...) so that drift in the machine's
load hits both alike, takes medians over the repeats and prints their ratio. Nothing here
asserts a time.

Per-step cost by difference: a run of N steps and a run of 2N steps of the same config;
(t(2N) - t(N)) / N cancels everything that does not grow with the step count (imports,
process start, rendezvous, model build, the first steps' warm-up, the end-of-run
validation and final-weights save).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PLAIN = Path(__file__).resolve().parent / "plain_gpt.py"
PY = sys.executable

# Every `loom train` of the benchmarks: no periodic checkpoints, one validation batch, quiet wandb.
LOOM_COMMON = ["checkpoint.every_n_steps=0", "trainer.limit_val_batches=1"]


def bench_env() -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    # Thread counts are chosen by each side from the core count (as Loom does), not inherited.
    env.pop("OMP_NUM_THREADS", None)
    return env


def loom_config(overrides: list[str]) -> dict[str, Any]:
    """The resolved config `loom train <overrides>` would run (composed in-process, no run)."""
    from omegaconf import OmegaConf

    from loom.pipeline import resolve

    return OmegaConf.to_container(resolve(list(overrides)), resolve=True)


def token_file(cfg: dict[str, Any]) -> Path:
    """The train token file Loom's LoomDataModule reads for this config: the tinycode train
    store's one shard of bytes (prepared if missing)."""
    from omegaconf import OmegaConf

    from loom.data.options import tinycode

    store = tinycode.stores(OmegaConf.create(cfg), None)["train"]
    if len(store.shards) != 1 or store.dtype.name != "uint8":
        raise SystemExit(f"plain_gpt.py reads one byte-level shard; {store.path} has {len(store.shards)} "
                         f"{store.dtype.name} shard(s)")
    return Path(store.shards[0].bin_path)


def plain_config(cfg: dict[str, Any]) -> str:
    """What plain_gpt.py needs, as JSON: the same model, optimizer, data and seed as Loom."""
    return json.dumps({
        "model": cfg["model"], "optim": cfg["optim"], "dataset": cfg["dataset"],
        "trainer": cfg["trainer"], "seed": cfg["seed"], "tokens": str(token_file(cfg)),
        "bucket_cap_mb": cfg["strategy"].get("bucket_cap_mb", 25),
    })


class Failed(RuntimeError):
    pass


def run_loom(overrides: list[str], root: Path, run_id: str, timeout: float = 900) -> dict[str, Any]:
    """`loom train` as a user runs it; returns summary.json plus the command's wall time."""
    cmd = [PY, "-m", "loom.cli", "train", *overrides, f"run.root={root}", f"run.id={run_id}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), cwd=root, timeout=timeout)
    wall = time.perf_counter() - t0
    run_dir = root / _experiment(overrides) / run_id
    if p.returncode != 0:
        raise Failed(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["command_wall_s"] = wall
    summary["run_dir"] = str(run_dir)
    return summary


def _experiment(overrides: list[str]) -> str:
    exp = [o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")]
    return exp[-1] if exp else "gpt"


def run_plain(config_json: str, steps: int, nproc: int = 1, extra: list[str] | None = None,
              timeout: float = 900) -> dict[str, Any]:
    """plain_gpt.py in one process, or under torchrun with `nproc` ranks (torch DDP, gloo)."""
    if nproc > 1:
        cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
               str(PLAIN)]
    else:
        cmd = [PY, str(PLAIN)]
    cmd += ["--config", config_json, "--steps", str(steps), *(extra or [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(), cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if lines else None
    if p.returncode != 0:
        if out is None or out.get("steps") != steps:
            raise Failed(f"plain_gpt.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        # Trained and reported; only the process-group teardown failed (seen once with gloo).
        print(f"  note: plain_gpt.py exited {p.returncode} after reporting its results (teardown)", flush=True)
    out["command_wall_s"] = wall
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fresh_root(prefix: str) -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"loom-bench-{prefix}-"))


def cleanup(root: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


def per_step_by_difference(short: float, long: float, n: int) -> float:
    """Seconds per step from a run of n and one of 2n steps."""
    return (long - short) / n


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"results: {path}")


def load() -> str:
    """The machine's 1/5/15-minute load average (others' work makes the figures noisy)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def compare_per_step(name: str, loom_overrides: list[str], nproc: int, steps: int, repeats: int,
                     keep: bool = False, loss_tol: float = 1e-4) -> dict[str, Any]:
    """`loom train` vs plain_gpt.py on the same config: per-step cost by difference, both
    sides interleaved (loom N, plain N, loom 2N, plain 2N; repeated), medians and ratios,
    and whether the final losses agree within `loss_tol` (absolute)."""
    cfg = loom_config([*loom_overrides, f"trainer.max_steps={steps}"])
    config_json = plain_config(cfg)
    root = fresh_root(name)
    rows: list[dict[str, Any]] = []
    print(f"[{name}] loom train {' '.join(loom_overrides)}  vs  plain PyTorch "
          f"({'torchrun ' + str(nproc) + ' ranks, DDP gloo' if nproc > 1 else '1 process'}); "
          f"{steps} and {2 * steps} steps, {repeats} repeats, load {load()}", flush=True)
    try:
        for i in range(repeats):
            row: dict[str, Any] = {"repeat": i}
            for n in (steps, 2 * steps):
                s = run_loom([*loom_overrides, *LOOM_COMMON, f"trainer.max_steps={n}"], root, f"{name}-{i}-{n}")
                p = run_plain(config_json, n, nproc)
                row[f"loom_{n}"] = {"train_time_s": s["train_time_s"], "wall_s": s["command_wall_s"],
                                    "final_loss": s["final_loss"], "steps": s["global_step"]}
                row[f"plain_{n}"] = {"loop_time_s": p["loop_time_s"], "wall_s": p["command_wall_s"],
                                     "final_loss": p["final_loss"], "steps": p["steps"], "threads": p["threads"]}
                print(f"  repeat {i} {n:4d} steps: loom train loop {s['train_time_s']:7.2f} s "
                      f"(command {s['command_wall_s']:6.2f} s)   plain loop {p['loop_time_s']:7.2f} s "
                      f"(command {p['command_wall_s']:6.2f} s)", flush=True)
            for side, key in (("loom", "train_time_s"), ("plain", "loop_time_s")):
                row[f"{side}_step_s"] = per_step_by_difference(row[f"{side}_{steps}"][key],
                                                               row[f"{side}_{2 * steps}"][key], steps)
                row[f"{side}_step_wall_s"] = per_step_by_difference(row[f"{side}_{steps}"]["wall_s"],
                                                                    row[f"{side}_{2 * steps}"]["wall_s"], steps)
            rows.append(row)
    finally:
        cleanup(root, keep)

    med = {k: median([r[k] for r in rows]) for k in ("loom_step_s", "plain_step_s", "loom_step_wall_s",
                                                     "plain_step_wall_s")}
    ratio = med["loom_step_s"] / med["plain_step_s"]
    ratio_wall = med["loom_step_wall_s"] / med["plain_step_wall_s"]
    per_repeat = [r["loom_step_s"] / r["plain_step_s"] for r in rows]
    # Robust to other load on the machine (interference only ever adds time): the difference
    # of the fastest N-step and the fastest 2N-step run of each side.
    best = {side: per_step_by_difference(min(r[f"{side}_{steps}"][key] for r in rows),
                                         min(r[f"{side}_{2 * steps}"][key] for r in rows), steps)
            for side, key in (("loom", "train_time_s"), ("plain", "loop_time_s"))}
    ratio_min = best["loom"] / best["plain"]
    losses = {
        "loom": rows[-1][f"loom_{2 * steps}"]["final_loss"],
        "plain": rows[-1][f"plain_{2 * steps}"]["final_loss"],
    }
    diff = abs(losses["loom"] - losses["plain"])
    same_everywhere = all(abs(r[f"loom_{n}"]["final_loss"] - r[f"plain_{n}"]["final_loss"]) <= loss_tol
                          for r in rows for n in (steps, 2 * steps))
    print(f"[{name}] per-step time by difference ((t{2 * steps} - t{steps}) / {steps}), median of {repeats}:")
    print(f"  training-loop time: loom {1000 * med['loom_step_s']:.1f} ms/step (summary train_time_s), "
          f"plain {1000 * med['plain_step_s']:.1f} ms/step  ->  ratio {ratio:.3f} "
          f"(per repeat: {', '.join(f'{x:.3f}' for x in per_repeat)})")
    print(f"  fastest runs only (min over repeats, then difference): loom {1000 * best['loom']:.1f} ms/step, "
          f"plain {1000 * best['plain']:.1f} ms/step  ->  ratio {ratio_min:.3f}")
    print(f"  whole-command wall: loom {1000 * med['loom_step_wall_s']:.1f} ms/step, "
          f"plain {1000 * med['plain_step_wall_s']:.1f} ms/step  ->  ratio {ratio_wall:.3f}")
    print(f"  final loss after {2 * steps} steps: loom {losses['loom']:.6f}, plain {losses['plain']:.6f} "
          f"(|diff| {diff:.2e}; {'match' if same_everywhere else 'DIFFER'} within {loss_tol:g} in every run)",
          flush=True)
    return {
        "name": name, "loom_overrides": loom_overrides, "processes": nproc, "steps": [steps, 2 * steps],
        "repeats": repeats, "median_step_ms": {k: 1000 * v for k, v in med.items()},
        "ratio": ratio, "ratio_wall": ratio_wall, "ratio_min": ratio_min,
        "min_step_ms": {k: 1000 * v for k, v in best.items()}, "ratio_per_repeat": per_repeat,
        "final_loss": losses, "final_loss_abs_diff": diff, "loss_tolerance": loss_tol,
        "losses_match": same_everywhere, "threads_per_process": rows[-1][f"plain_{steps}"]["threads"],
        "runs": rows,
    }
