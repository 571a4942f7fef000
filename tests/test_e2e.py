"""The walking skeleton end to end: the real `loom train`, 2 processes via torchrun.

The run is the default 2-rank ddp job that tests/test_tracking.py measures (`DDP_ARGS`, shared
through the `shared` registry: one launch for both files)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_loom
from safetensors.torch import load_file
from test_tracking import DDP_ARGS, SENTINELS, STEPS

from loom.models.gpt.network import GPT

pytestmark = pytest.mark.slow

METRICS = {"train/loss", "train/lr", "perf/step_time_ms", "perf/data_wait_ms", "perf/samples_per_sec",
           "perf/tokens_per_sec", "sys/cpu_percent", "sys/rss_gb"}


def test_default_job_two_processes_end_to_end(shared):
    r = shared.get(*DDP_ARGS, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    run = r.run_dir
    for name in ("config.yaml", "plan.json", "metrics.csv", "summary.json", "final/model.safetensors",
                 "logs/rank-0.log", "logs/rank-1.log"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "step-0000010.ckpt").exists()
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # one wandb run, not one per rank

    s = r.summary()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["strategy"] == "ddp"
    assert s["global_step"] == STEPS and s["run_id"] == run.name
    assert s["tokens"] == STEPS * 2 * 16 * 128 and s["samples"] == STEPS * 2 * 16
    assert s["throughput"]["tokens_per_sec"] > 0
    assert s["final_weights"] == "final/model.safetensors"
    assert s["memory"]["param_bytes_per_rank"][0] == s["memory"]["param_bytes_per_rank"][1] > 0

    rows = r.metrics()
    assert METRICS <= set(rows[0]), set(rows[0])
    losses = r.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]
    assert s["final_loss"] == pytest.approx(losses[STEPS])

    # final weights: plain safetensors, loadable into the model without Loom's trainer
    state = load_file(str(run / "final" / "model.safetensors"))
    model = GPT(n_layer=2, n_head=4, d_model=128, vocab_size=256, block_size=256)
    model.load_state_dict(state)
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)

    # the launcher printed where the run dir is and a summary
    assert f"run dir: {run}" in r.out and "tokens/s" in r.out

    # the identical command again: says so, exits 0, overwrites nothing (and trains nothing)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    again = run_loom("train", *DDP_ARGS, root=run.parents[1], env=SENTINELS)
    assert again.rc == 0 and "already completed" in again.out
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert before == after
