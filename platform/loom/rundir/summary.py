"""summary.json: the run's outcome, written by rank 0 (or by the launcher if the workers died)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.atomic import atomic_write_text
from loom.layout import ParallelLayout
from loom.rundir.paths import RunDir

STATUSES = ("completed", "failed", "preempted")


def empty_summary(cfg: DictConfig, run_id: str, layout: ParallelLayout) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "status": "failed",
        "strategy": cfg.strategy.name,
        "hardware": cfg.hardware.name,
        "world_size": layout.world,
        "num_nodes": layout.num_nodes,
        # {dp_replicate, dp_shard, tp, pp, ep, pp_schedule, pp_microbatches} (loom.layout)
        "parallel": layout.parallel(),
        "global_step": 0,
        "samples": 0,
        "tokens": 0,
        "wall_time_s": None,
        "train_time_s": None,
        "final_loss": None,
        "first_loss": None,
        # the last validation's val/* metrics: {"loss": ..., "acc": ..., "step": N}, and with several
        # validation sources `per_source` {name: loss} (loom.tracking.sources)
        "validation": None,
        "final_weights": None,
        "resumed_from_step": None,
        "restarts": 0,
        # one entry per attempt: {start_step, world_size, num_nodes, reason, and its span: end_step,
        # samples, train_s, ...} (loom.rundir.world_history); `world_history` is the same list
        "attempts": [],
        "world_history": [],
        # every attempt's span added up (loom.rundir.world_history.run_totals): steps trained again
        # after a restart count; `train_time_s` is time.train_s
        "steps_trained": 0,
        "time": {"compile_s": None, "first_step_s": None, "validation_s": None, "checkpoint_s": None,
                 "eval_s": None, "train_s": None, "wall_s": None},
        # steady state (the log windows after tracking.warmup_steps / the first one, less any window
        # in which a rank compiled),
        # the whole run's average in `overall` (loom.tracking.clock)
        "throughput": {"samples_per_sec": None, "tokens_per_sec": None, "tflops_per_device": None, "mfu": None,
                       "mfu_error": None, "steady": False, "steady_from_step": None,
                       "overall": {"samples_per_sec": None, "tokens_per_sec": None, "tflops_per_device": None,
                                   "mfu": None}},
        "memory": {
            "peak_rss_gb_per_rank": None,
            "build_peak_rss_gb_per_rank": None,
            "peak_gpu_mem_gb_per_rank": None,       # torch.cuda.max_memory_allocated
            "peak_gpu_reserved_gb_per_rank": None,  # torch.cuda.max_memory_reserved (allocator blocks)
            "param_bytes_per_rank": None,
            "optim_state_bytes_per_rank": None,
        },
        "utilization": {"cpu_percent_mean": None, "gpu_util_mean": None},
        # frames torch compiled in training after each attempt's first step (loom.tracking.compiles):
        # their log windows are out of `throughput`, their seconds in time.compile_s; 0 when not compiled
        "recompiles": {"count": 0, "steps": [], "reasons": []},
        # the loader's share of step time (loom.tracking.data_wait): the largest log window's after
        # each attempt's first, and the one warning's step and cause (null: the loader kept up)
        "data_wait": {"max_window_pct": None, "max_window_step": None, "warned_at_step": None, "cause": None,
                      "threshold_pct": 5.0},
        # A failed run's root failure {type, message, rank, step, log, where} (loom.rundir.failures).
        "error": None,
    }


def validation_text(v: dict[str, Any] | None) -> str:
    """summary.json's `validation` in words: `loss 1.2345, acc 0.9120 at step 200`."""
    if not v:
        return "none (no validation ran)"
    metrics = ", ".join(f"{k} {x:.4f}" for k, x in v.items() if k != "step" and isinstance(x, (int, float)))
    return f"{metrics} at step {v['step']}" if v.get("step") is not None else metrics


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Atomic write: a reader never sees half a summary."""
    assert summary["status"] in STATUSES, summary["status"]
    return atomic_write_text(RunDir(run_dir).summary, json.dumps(summary, indent=2, sort_keys=False) + "\n")


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = RunDir(run_dir).summary
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def summary_mark(run_dir: Path) -> str | None:
    """A fingerprint of summary.json as it is now (None: absent). Compared after the ranks exit,
    it says whether global rank 0 wrote a summary during this launch; unlike a modification time
    it does not depend on the clocks of the nodes and the shared file server agreeing."""
    try:
        return hashlib.sha1(RunDir(run_dir).summary.read_bytes()).hexdigest()
    except OSError:
        return None
