"""strategy=pp at 2 ranks on CPU (gloo), real processes: the same losses as the shared `single`
run at the same global batch (8), every single-stage schedule the same, and
final/model.safetensors with the single-device keys and shapes (each stage's tensors gathered
from its owner). gpt_tiny's 2 blocks make one block per stage."""

from __future__ import annotations

from conftest import GLOBAL_BATCH, PARITY, STEPS, launching_fixture
from safetensors.torch import load_file

# pp has one data-parallel rank: both stages read the whole global batch, split into 2 microbatches.
PP = ("strategy=pp", "hardware.devices=2", *PARITY, f"dataset.batch_size={GLOBAL_BATCH}")


@launching_fixture(scope="module")
def runs(shared, single_run) -> dict:
    out = {"single": single_run}
    for sched in ("1f1b", "gpipe"):
        out[sched] = shared.get(*PP, f"strategy.pp_schedule={sched}")
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
    assert s["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2, "ep": 1, "cp": 1,
                             "cp_style": None, "pp_schedule": "1f1b",
                             "pp_microbatches": 2}
    assert runs["single"].summary()["parallel"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "ep": 1,
                                                    "cp": 1, "cp_style": None, "pp_schedule": None, "pp_microbatches": None}
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
    # blocks.0 lives on stage 0 (with the embeddings), blocks.1 on stage 1 (with the head)
    assert {"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "wte.weight", "lm_head.weight"} <= set(got)
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst < 1e-3, worst
