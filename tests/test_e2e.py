"""The walking skeleton end to end: the real `loom train`, 2 processes via torchrun."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from loom.models.gpt import GPT

pytestmark = pytest.mark.slow

METRICS = {"train/loss", "train/lr", "perf/step_time_ms", "perf/data_wait_ms", "perf/samples_per_sec",
           "perf/tokens_per_sec", "sys/cpu_percent", "sys/rss_gb"}


@pytest.mark.launch
def test_default_job_two_processes_end_to_end(loom):
    args = ("train", "dataset.max_bytes=2000000", "trainer.max_steps=12", "trainer.log_every_n_steps=2",
            "checkpoint.every_n_steps=6")
    r = loom(*args)
    assert r.rc == 0, r.out + r.err
    run = r.run_dir
    for name in ("config.yaml", "plan.json", "metrics.csv", "summary.json", "final/model.safetensors",
                 "logs/rank-0.log", "logs/rank-1.log"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "step-0000006.ckpt").exists()
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # one wandb run, not one per rank

    s = r.summary()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["strategy"] == "ddp"
    assert s["global_step"] == 12 and s["run_id"] == run.name
    assert s["tokens"] == 12 * 2 * 16 * 128 and s["samples"] == 12 * 2 * 16
    assert s["throughput"]["tokens_per_sec"] > 0
    assert s["final_weights"] == "final/model.safetensors"
    assert s["memory"]["param_bytes_per_rank"][0] == s["memory"]["param_bytes_per_rank"][1] > 0

    rows = r.metrics()
    assert METRICS <= set(rows[0]), set(rows[0])
    losses = r.losses()
    assert sorted(losses) == [2, 4, 6, 8, 10, 12]
    assert losses[12] < losses[2]
    assert s["final_loss"] == pytest.approx(losses[12])

    # final weights: plain safetensors, loadable into the model without Loom's trainer
    state = load_file(str(run / "final" / "model.safetensors"))
    model = GPT(n_layer=2, n_head=4, d_model=128, vocab_size=256, block_size=256)
    model.load_state_dict(state)
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)

    # the launcher printed where the run dir is and a summary
    assert f"run dir: {run}" in r.out and "tokens/s" in r.out

    # the identical command again: says so, exits 0, overwrites nothing
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    again = loom(*args)
    assert again.rc == 0 and "already completed" in again.out
    after = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert before == after
