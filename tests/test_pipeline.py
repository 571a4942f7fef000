"""strategy=pp at 2 ranks on CPU (gloo), real processes: the same losses as `single` at the
same global batch, every single-stage schedule the same, and final/model.safetensors with the
single-device keys and shapes (each stage's tensors gathered from its owner)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import FAST, LoomResult, run_loom, start_loom, wait_for, worker_pids
from safetensors.torch import load_file

STEPS = 10
# pp has one data-parallel rank: both stages read the same batch of 4, split into 2 microbatches.
ARGS = [*FAST, "hardware=cpu", "model=gpt_tiny", "model.n_layer=4", f"trainer.max_steps={STEPS}",
        "dataset.batch_size=4", "dataset.seq_len=64"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp")
    out = {"single": run_loom("train", "strategy=single", "hardware.devices=1", *ARGS, root=root)}
    for sched in ("1f1b", "gpipe"):
        out[sched] = run_loom("train", "strategy=pp", "hardware.devices=2", f"strategy.pp_schedule={sched}",
                              *ARGS, root=root)
    for r in out.values():
        assert r.rc == 0, r.out + r.err
    return out


def test_pp_matches_single(runs):
    single, pp = runs["single"].losses(), runs["1f1b"].losses()
    assert sorted(pp) == list(range(1, STEPS + 1))
    assert abs(pp[1] - single[1]) < 1e-4, (pp[1], single[1])
    assert abs(pp[STEPS] - single[STEPS]) < 1e-3, (pp[STEPS], single[STEPS])
    assert pp[STEPS] < pp[1] - 0.3  # it trains
    s = runs["1f1b"].summary()
    assert s["status"] == "completed" and s["world_size"] == 2
    assert s["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2, "pp_schedule": "1f1b",
                             "pp_microbatches": 2}
    assert runs["single"].summary()["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1,
                                                    "pp_schedule": None, "pp_microbatches": None}
    val = s.get("validation") or {}
    assert abs(val["loss"] - runs["single"].summary()["validation"]["loss"]) < 1e-3


def test_schedules_agree(runs):
    a, b = runs["1f1b"].losses(), runs["gpipe"].losses()
    assert all(abs(a[k] - b[k]) < 1e-4 for k in a), (a, b)


def test_final_weights_have_single_keys_and_shapes(runs):
    ref = load_file(runs["single"].run_dir / "final" / "model.safetensors")
    got = load_file(runs["1f1b"].run_dir / "final" / "model.safetensors")
    assert list(got) == list(ref)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    assert {"blocks.3.attn.qkv.weight", "wte.weight", "lm_head.weight"} <= set(got)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-3, worst


# ----------------------------------------------------------------------------- resume
# Dropout on, so each stage's RNG state must come back too; checkpoints every 4 steps.
RESUME_STEPS = 12
RESUME_ARGS = ["train", "strategy=pp", "hardware.devices=2", *ARGS, f"trainer.max_steps={RESUME_STEPS}",
               "checkpoint.every_n_steps=4", "model.dropout=0.1", "run.id=r"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> LoomResult:
    """The uninterrupted pp run the interrupted ones must reproduce bit for bit."""
    r = run_loom(*RESUME_ARGS, root=tmp_path_factory.mktemp("pp-ref"))
    assert r.rc == 0, r.out + r.err
    return r


def _assert_same_run(a: LoomResult, b: LoomResult) -> None:
    la, lb = a.losses(), b.losses()
    assert sorted(la) == sorted(lb) == list(range(1, RESUME_STEPS + 1))
    assert la == lb, "loss curves differ"
    wa = load_file(a.run_dir / "final" / "model.safetensors")
    wb = load_file(b.run_dir / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_sigkill_of_one_stage_restarts_and_resumes_bit_identical(tmp_path, reference):
    """SIGKILL of one stage's rank after the step-4 checkpoint: torchrun restarts both ranks,
    each stage reloads its own weights, optimizer state (param groups too) and RNG."""
    run_dir = tmp_path / "gpt" / "r"
    proc = start_loom(*RESUME_ARGS, "hardware.max_restarts=1", root=tmp_path)
    wait_for(run_dir / "checkpoints" / "step-0000004.ckpt", proc)
    victims = worker_pids(run_dir)
    assert len(victims) == 2
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    r = LoomResult(0, out, "", run_dir)
    s = r.summary()
    assert s["status"] == "completed" and s["restarts"] == 1
    assert s["resumed_from_step"] is not None and 4 <= s["resumed_from_step"] < RESUME_STEPS
    _assert_same_run(reference, r)
