"""summary.json: the run's outcome, written by rank 0 (or by the launcher if the workers died)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

STATUSES = ("completed", "failed", "preempted")


def empty_summary(cfg: DictConfig, run_id: str) -> dict[str, Any]:
    hw = cfg.hardware
    return {
        "run_id": run_id,
        "status": "failed",
        "strategy": cfg.strategy.name,
        "hardware": hw.name,
        "world_size": hw.devices * hw.num_nodes,
        "num_nodes": hw.num_nodes,
        "global_step": 0,
        "samples": 0,
        "tokens": 0,
        "wall_time_s": None,
        "train_time_s": None,
        "final_loss": None,
        "first_loss": None,
        "final_weights": None,
        "resumed_from_step": None,
        "restarts": 0,
        "throughput": {"samples_per_sec": None, "tokens_per_sec": None, "tflops_per_device": None, "mfu": None},
        "memory": {
            "peak_rss_gb_per_rank": None,
            "peak_gpu_mem_gb_per_rank": None,
            "param_bytes_per_rank": None,
            "optim_state_bytes_per_rank": None,
        },
        "utilization": {"cpu_percent_mean": None, "gpu_util_mean": None},
    }


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Atomic write: a reader never sees half a summary."""
    assert summary["status"] in STATUSES, summary["status"]
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
