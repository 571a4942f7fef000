"""The per-step estimator of overhead.py and ddp_parity.py: two sides in turns (baton.py).

A repeat starts both sides at once (a `loom train`, and plain_gpt.py or another `loom train`)
and they take turns step by step. Each side's steady steps (the first `WARM` and the last are
left out) give, per repeat:
  - paired (the headline): the median over steps i of a's step i / b's step i, two steps
    that ran next to each other in time, so a burst of load from elsewhere that lasts a few
    steps cancels in each pair (a Loom-vs-Loom check reads 1.001 [0.998, 1.004] at 2 ranks);
  - wall: the median step of each side, and the median over log windows of each window's
    mean (each window holds one log step: the periodic work of log steps is in);
  - CPU: the same per log window and the mean over steps, of the process CPU time per step
    (user + system, every thread: monitor threads included; summed over ranks), and the
    mean plus its child processes' CPU over the same steps (a tracker's service process);
and the ratios a/b of each. Which side moves first alternates from repeat to repeat. Over the
repeats, a ratio is the geometric mean with a 95% Student-t interval on the log ratios
(repeats are independent pairs of processes); differences (a - b, ms/step) the same way.
Nothing here asserts a time.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench import (
    LOOM_COMMON,
    PLAIN,
    PY,
    REPO,
    Failed,
    bench_env,
    cleanup,
    fresh_root,
    load,
    loom_config,
    plain_config,
)

BENCH_DIR = Path(__file__).resolve().parent
WARM = 5  # steps left out at the start of each side's run (allocator, caches, first-step work)
# 97.5% quantiles of Student's t by degrees of freedom (a 95% two-sided interval)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    lower = max(k for k in _T975 if k <= df) if df >= 1 else 1
    return _T975[lower] if df < 30 else 1.96


@dataclass
class Side:
    """One side of a comparison: `loom train <overrides>`, or plain_gpt.py (`overrides` None)."""

    label: str
    overrides: list[str] | None = None
    slow: float = 0.0
    slow_kind: str = "sleep"

    @property
    def is_loom(self) -> bool:
        return self.overrides is not None


def _command(side: Side, name: str, steps: int, nproc: int, baton_dir: Path, root: Path, run_id: str,
             config_json: str) -> list[str]:
    if side.is_loom:
        cb = (f"trainer.callbacks=[{{_target_:baton.loom_callback,dir:'{baton_dir}',side:{name},"
              f"slow:{side.slow},slow_kind:{side.slow_kind}}}]")
        return [PY, "-m", "loom.cli", "train", *side.overrides, *LOOM_COMMON, f"trainer.max_steps={steps}",
                cb, "security.allow_targets=[baton]", f"run.root={root}", f"run.id={run_id}"]
    head = ([PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
             f"--master-port={_free_port()}"] if nproc > 1 else [PY])
    return [*head, str(PLAIN), "--config", config_json, "--steps", str(steps), "--baton", str(baton_dir),
            "--side", name, "--slow", str(side.slow), "--slow-kind", side.slow_kind]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_turns(a: Side, b: Side, steps: int, nproc: int, root: Path, tag: str, config_json: str,
              a_first: bool = True, timeout: float = 1200) -> dict[str, dict[str, Any]]:
    """Both sides at once, in turns; returns each side's per-rank step records."""
    baton_dir = root / f"baton-{tag}"
    baton_dir.mkdir(parents=True)
    env = bench_env()
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    order = [("a", a), ("b", b)] if a_first else [("b", b), ("a", a)]
    procs = {}
    for turn, (key, side) in zip(("a", "b"), order, strict=True):
        cmd = _command(side, turn, steps, nproc, baton_dir, root, f"{tag}-{key}", config_json)
        log = open(root / f"{tag}-{key}.log", "w")
        procs[key] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log, turn)
    deadline = time.monotonic() + timeout
    for key, (p, log, _) in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()
        if p.returncode != 0:
            text = (root / f"{tag}-{key}.log").read_text()[-4000:]
            raise Failed(f"side {key} ({(a if key == 'a' else b).label}) exited {p.returncode}:\n{text}")
    out = {}
    for key, (_, _, turn) in procs.items():
        files = sorted(baton_dir.glob(f"steps-{turn}-*.json"))
        if not files:
            raise Failed(f"side {key} wrote no step records in {baton_dir}")
        out[key] = {"ranks": [json.loads(f.read_text()) for f in files],
                    "final_loss": _final_loss(a if key == "a" else b, root, f"{tag}-{key}")}
    return out


def _final_loss(side: Side, root: Path, run_id: str) -> float | None:
    """summary.json's final_loss (Loom), or the last JSON line of plain_gpt.py's output."""
    if side.is_loom:
        found = list(root.glob(f"*/{run_id}/summary.json"))
        return json.loads(found[0].read_text()).get("final_loss") if found else None
    lines = [ln for ln in (root / f"{run_id}.log").read_text().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])["final_loss"] if lines else None


def window_medians(values: list[float], first: int, every: int) -> float:
    """The median over complete log windows of each window's mean: each window of `every` steps
    holds exactly one log step (its periodic work is in), and a window that another process's
    burst of load hit is outvoted by the others. `values[i]` is step i + 1's."""
    starts = range(first, len(values) - every + 1, every)
    means = [statistics.fmean(values[s:s + every]) for s in starts]
    return statistics.median(means) if means else statistics.fmean(values[first:])


def side_stats(rec: dict[str, Any], log_every: int) -> dict[str, float]:
    """One side's steady-step figures: wall from rank 0 (every rank waits for the slowest in
    the collectives), CPU summed over the ranks (the job's CPU per step)."""
    ranks = rec["ranks"]
    wall_all = ranks[0]["wall_s"]
    wall = wall_all[WARM:-1]
    n = len(wall)
    if n < 3:
        raise Failed(f"too few steady steps ({n}): give more --steps (> {WARM + 4})")
    cpu_all = [sum(col) for col in zip(*(r["cpu_s"] for r in ranks), strict=True)]
    # windows start right after a log step: steps k*every+1 .. (k+1)*every (step numbers 1-based)
    first = -(-WARM // log_every) * log_every
    kids = sum((r["children_cpu_s"][1] - r["children_cpu_s"][0]) if len(r["children_cpu_s"]) == 2 else 0.0
               for r in ranks) / n
    cpu = statistics.fmean(cpu_all[WARM:-1])
    return {"wall_median_ms": 1000 * statistics.median(wall), "wall_mean_ms": 1000 * statistics.fmean(wall),
            "wall_window_ms": 1000 * window_medians(wall_all[:-1], first, log_every),
            "cpu_ms": 1000 * cpu, "cpu_window_ms": 1000 * window_medians(cpu_all[:-1], first, log_every),
            "children_cpu_ms": 1000 * kids, "cpu_tree_ms": 1000 * (cpu + kids),
            "minor_faults": statistics.median([sum(col) for col in zip(
                *(r.get("minor_faults") or [0] * len(r["cpu_s"]) for r in ranks), strict=True)][WARM:-1]),
            "steady_steps": n, "threads": ranks[0].get("threads")}


def paired(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """The median over steady steps of a's step i against b's step i, its neighbour in time
    (ratio, and difference in ms): a burst of load shared by the pair cancels."""
    wa, wb = a["ranks"][0]["wall_s"][WARM:-1], b["ranks"][0]["wall_s"][WARM:-1]
    return (statistics.median(x / y for x, y in zip(wa, wb, strict=False)),
            1000 * statistics.median(x - y for x, y in zip(wa, wb, strict=False)))


PAIRED = "wall_paired"
METRICS = ("wall_median_ms", "wall_window_ms", "wall_mean_ms", "cpu_window_ms", "cpu_ms", "cpu_tree_ms")


def interval(values: list[float], log: bool) -> dict[str, float]:
    """Mean and 95% t-interval (on logs for ratios: the geometric mean and its interval)."""
    xs = [math.log(v) for v in values] if log else list(values)
    m = statistics.fmean(xs)
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    f = math.exp if log else (lambda v: v)
    return {"value": f(m), "low": f(m - half), "high": f(m + half), "n": len(xs)}


def compare_in_turns(name: str, a: Side, b: Side, nproc: int, steps: int, repeats: int, config_overrides: list[str],
                     keep: bool = False) -> dict[str, Any]:
    """Repeats of a vs b in turns; per-repeat stats, ratios a/b and differences a - b with intervals."""
    cfg = loom_config([*config_overrides, f"trainer.max_steps={steps}"])
    config_json = plain_config(cfg)
    root = fresh_root(name)
    rows: list[dict[str, Any]] = []
    print(f"[{name}] {a.label}  vs  {b.label}: {nproc} process(es) each, {steps} steps in turns, "
          f"{repeats} repeats (steady steps {WARM + 1}..{steps - 1}), load {load()}", flush=True)
    try:
        for i in range(repeats):
            rec = run_turns(a, b, steps, nproc, root, f"r{i}", config_json, a_first=(i % 2 == 0))
            every = int(cfg["trainer"]["log_every_n_steps"])
            row = {"repeat": i, "a_first": i % 2 == 0, "a": side_stats(rec["a"], every), "b": side_stats(rec["b"], every),
                   "final_loss": {k: rec[k]["final_loss"] for k in ("a", "b")}}
            row["ratio"] = {m: row["a"][m] / row["b"][m] for m in METRICS}
            row["diff_ms"] = {m: row["a"][m] - row["b"][m] for m in METRICS}
            row["ratio"][PAIRED], row["diff_ms"][PAIRED] = paired(rec["a"], rec["b"])
            rows.append(row)
            q = row["ratio"]
            print(f"  repeat {i}: wall median {row['a']['wall_median_ms']:.1f} vs {row['b']['wall_median_ms']:.1f} ms "
                  f"({q['wall_median_ms']:.3f}), paired {q[PAIRED]:.3f}, per log window {q['wall_window_ms']:.3f}, mean {q['wall_mean_ms']:.3f}; "
                  f"CPU per log window {row['a']['cpu_window_ms']:.1f} vs {row['b']['cpu_window_ms']:.1f} ms "
                  f"({q['cpu_window_ms']:.3f}), mean {q['cpu_ms']:.3f}, with children {q['cpu_tree_ms']:.3f}; "
                  f"page faults/step {row['a']['minor_faults']:.0f} vs {row['b']['minor_faults']:.0f}; "
                  f"load {load()}", flush=True)
    finally:
        cleanup(root, keep)
    return summarize(name, a, b, nproc, steps, rows)


def summarize(name: str, a: Side, b: Side, nproc: int, steps: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratio = {m: interval([r["ratio"][m] for r in rows], log=True) for m in (PAIRED, *METRICS)}
    diff = {m: interval([r["diff_ms"][m] for r in rows], log=False) for m in (PAIRED, *METRICS)}
    mean_side = {s: {m: statistics.fmean(r[s][m] for r in rows) for m in (*METRICS, "children_cpu_ms")}
                 for s in ("a", "b")}
    mean_side["a"][PAIRED] = mean_side["b"][PAIRED] = float("nan")
    losses = [r["final_loss"] for r in rows]
    same = all(x["a"] is not None and x["b"] is not None and abs(x["a"] - x["b"]) <= 1e-4 for x in losses)
    label = {PAIRED: "wall, paired steps", "wall_median_ms": "wall, median step", "wall_window_ms": "wall, per log window",
             "wall_mean_ms": "wall, mean step", "cpu_window_ms": "CPU, per log window", "cpu_ms": "CPU, mean step",
             "cpu_tree_ms": "CPU + children, mean step"}
    print(f"[{name}] {a.label} / {b.label}, {len(rows)} repeats, 95% intervals:")
    for m in (PAIRED, *METRICS):
        r, d = ratio[m], diff[m]
        print(f"  {label[m]:26s} {mean_side['a'][m]:8.1f} vs {mean_side['b'][m]:8.1f} ms  ratio {r['value']:.3f} "
              f"[{r['low']:.3f}, {r['high']:.3f}]   a-b {d['value']:+7.2f} ms [{d['low']:+.2f}, {d['high']:+.2f}]",
              flush=True)
    print(f"  final loss: {losses[-1]['a']} vs {losses[-1]['b']} "
          f"({'the same' if same else 'DIFFERENT'} within 1e-4 in every repeat)", flush=True)
    return {"name": name, "a": a.label, "b": b.label, "a_overrides": a.overrides, "b_overrides": b.overrides,
            "a_slow": [a.slow, a.slow_kind], "b_slow": [b.slow, b.slow_kind], "processes": nproc,
            "steps": steps, "warm_steps": WARM, "repeats": len(rows), "ratio": ratio, "diff_ms": diff,
            "mean_ms": mean_side, "final_loss": losses[-1], "losses_match": same, "runs": rows}


# The monitor legs (`--monitors`), as override dicts (a group is named once on a command line).
LEGS: dict[str, dict[str, str]] = {
    # the bare platform: Lightning, the recorder, data position, checkpointing and GC callbacks
    "none": {"tracking": "none", "tracking.stragglers": "false", "hardware.hang_timeout_s": "0"},
    # the benchmarks' historical leg: Loom's defaults without a tracker
    "default": {"tracking": "none"},
    # every monitor that can stay on for a whole run (the profiler is a window, off here)
    "all": {"tracking": "offline", "tracking.stragglers": "true", "hardware.hang_timeout_s": "null"},
}
# Each monitor alone, over the `none` leg (`--prices`): what turning it on costs.
MONITORS: dict[str, dict[str, str]] = {
    "metrics.csv (tracking=csv)": {"tracking": "csv"},
    "wandb offline (tracking=offline tracking.csv=false)": {"tracking": "offline", "tracking.csv": "false"},
    "stragglers (tracking.stragglers=true)": {"tracking.stragglers": "true"},
    "hang watchdog (hardware.hang_timeout_s=null)": {"hardware.hang_timeout_s": "null"},
    "all of them (--monitors all)": LEGS["all"],
}


def overrides_of(*parts: dict[str, str]) -> list[str]:
    merged: dict[str, str] = {}
    for p in parts:
        merged.update(p)
    return [f"{k}={v}" for k, v in merged.items()]


def prices(name: str, base: list[str], nproc: int, steps: int, repeats: int, keep: bool = False,
           only: list[str] | None = None) -> dict[str, Any]:
    """Each monitor's price: Loom with it on vs Loom with every monitor off, in turns."""
    off = Side("loom, monitors off", [*base, *overrides_of(LEGS["none"])])
    table = {}
    for label, on in MONITORS.items():
        if only and not any(o in label for o in only):
            continue
        side = Side(f"loom + {label}", [*base, *overrides_of(LEGS["none"], on)])
        table[label] = compare_in_turns(f"{name}-price", side, off, nproc, steps, repeats, base, keep=keep)
    print(f"[{name}] each monitor's price per step (on - off, mean of {repeats} repeats, 95% intervals): wall of "
          "the paired steps (the step itself), wall per log window (log-step work spread in), CPU per step, and "
          "CPU with child processes (a tracker's service)")
    for label, res in table.items():
        cells = []
        for m in (PAIRED, "wall_window_ms", "cpu_ms", "cpu_tree_ms"):
            d = res["diff_ms"][m]
            cells.append(f"{d['value']:+6.2f} [{d['low']:+.2f}, {d['high']:+.2f}]")
        print(f"  {label:52s} " + "  ".join(cells), flush=True)
    return table
