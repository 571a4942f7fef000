"""Every parallelism strategy, for real: `loom train` on CPU processes (gloo, fp32).

One launch per strategy checks completion, a falling loss, the bytes each rank holds and the
step-1 loss against `single`. (Resuming each strategy, at the same world and at another one, is
test_resume.py's, test_elastic.py's and test_elastic_zero.py's.) Bad strategy input must fail in
validation (exit 2, no run dir).

Why step-1 losses must agree: every strategy builds the same model from the same seed before
any sharding, and the samples match. A 2-rank run with micro batch B gives rank r the indices
perm[r::2] of DistributedSampler's seeded permutation (same seed, same dataset length, so the
same permutation), and `single` with batch 2B reads perm[0:2B]: the same 2B windows (checked
below, without processes). The logged loss is the mean over ranks of equal-size batch means,
i.e. the mean over the 2B windows. What differs is only float32 summation order (sharded or
TP-split matmuls, a mean of two means): relative error ~1e-7 x a few reductions, far below the
1e-4 tolerance, while any difference in data or weights changes the loss by > 1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import STEPS, STRATEGIES, B, refused

pytestmark = pytest.mark.slow

STEP1_TOL = 1e-4


def _params() -> int:
    from omegaconf import OmegaConf

    from loom.models.spec import gpt_spec

    m = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "gpt_tiny.yaml")
    return gpt_spec(m, 64).params


@pytest.fixture(scope="module")
def runs(strategy_runs) -> dict:
    return strategy_runs


def test_distributed_sampler_matches_single_batch():
    """The 2-rank first batches together are the single-process first batch (same seed)."""
    from torch.utils.data import DistributedSampler

    data = list(range(1001))
    one = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1234, drop_last=True))
    ranks = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=1234, drop_last=True))
             for r in (0, 1)]
    assert sorted(ranks[0][:B] + ranks[1][:B]) == sorted(one[: 2 * B])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_and_matches_single(runs, strategy):
    r, ref = runs[strategy], runs["single"]
    assert ref.rc == 0, ref.out + ref.err
    assert r.rc == 0, r.out + r.err
    s = r.summary()
    assert s["status"] == "completed" and s["global_step"] == STEPS
    assert s["world_size"] == (4 if strategy == "fsdp_tp" else 2)
    losses = r.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.3, losses
    assert abs(losses[1] - ref.losses()[1]) < STEP1_TOL, (losses[1], ref.losses()[1])
    # Same global batch, same init, same optimizer, clipping included: the whole curve agrees
    # (TP/sharding only reorder float32 sums; 6 Adam steps keep that below 1e-3).
    for step, loss in ref.losses().items():
        assert abs(losses[step] - loss) < 1e-3, (step, losses[step], loss)
    assert (r.run_dir / "final" / "model.safetensors").exists()


def test_final_weights_have_the_plain_model_keys(runs):
    from safetensors.torch import load_file

    ref = load_file(str(runs["single"].run_dir / "final" / "model.safetensors"))
    for s in STRATEGIES:
        w = load_file(str(runs[s].run_dir / "final" / "model.safetensors"))
        assert w.keys() == ref.keys(), s
        assert all(w[k].shape == ref[k].shape for k in ref), s


def test_bytes_per_rank(runs):
    """Counted from the tensors each rank holds (fp32: 4 bytes/param; Adam m + v: 8)."""
    total = 4 * _params()
    mem = {s: runs[s].summary()["memory"] for s in STRATEGIES}
    for s in STRATEGIES:
        print(s, mem[s]["param_bytes_per_rank"], mem[s]["optim_state_bytes_per_rank"])

    def close(x: float, want: float, tol: float = 0.02) -> bool:  # one unshardable remainder
        return abs(x - want) <= tol * want

    assert mem["ddp"]["param_bytes_per_rank"] == [total, total]
    assert mem["ddp"]["optim_state_bytes_per_rank"] == [2 * total, 2 * total]
    for s in ("fsdp", "zero3", "zero3_offload"):
        assert all(close(x, total / 2) for x in mem[s]["param_bytes_per_rank"]), (s, mem[s])
    # FSDP2 shards Adam's m and v with the params; ZeRO's optimizer state is the fp32 master
    # partition + m + v (12 bytes/param over all ranks), as in the ZeRO paper.
    assert all(close(x, total) for x in mem["fsdp"]["optim_state_bytes_per_rank"]), mem["fsdp"]
    for s in ("zero1", "zero2", "zero3", "zero3_offload"):
        assert all(close(x, 3 * total / 2) for x in mem[s]["optim_state_bytes_per_rank"]), (s, mem[s])
    for s in ("zero1", "zero2"):
        assert mem[s]["param_bytes_per_rank"] == [total, total], s
    # 2-way TP x 2-way FSDP: TP-split block weights are in quarters, the rest in halves.
    assert all(x < total / 2 for x in mem["fsdp_tp"]["param_bytes_per_rank"]), mem["fsdp_tp"]


def test_ddp_comm_hook_registers_on_cpu(runs):
    log = (runs["ddp"].run_dir / "logs" / "rank-0.log").read_text()
    assert "ddp comm hook fp16_compress_hook registered on cpu" in log


# ----------------------------------------------------------------------------- bad input


def test_bad_strategy_input_fails_fast(loom, tmp_path):
    err = refused(tmp_path, "strategy=fsdp_tp", "hardware.devices=4", "strategy.tensor_parallel=3")
    assert "strategy.tensor_parallel=3" in err and "hardware.devices=4" in err and "1, 2, 4" in err
    err = refused(tmp_path, "strategy=ddp", "strategy.comm_hook=zip")
    assert "strategy.comm_hook='zip'" in err and "powersgd" in err
    err = refused(tmp_path, "strategy=zero2", f"strategy.deepspeed_config={tmp_path / 'missing.json'}")
    assert "strategy.deepspeed_config" in err and "no such file" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2},')
    err = refused(tmp_path, "strategy=zero2", f"strategy.deepspeed_config={bad}")
    assert "not valid JSON" in err
    conflict = tmp_path / "conflict.json"
    conflict.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}))
    err = refused(tmp_path, "strategy=zero3", f"strategy.deepspeed_config={conflict}")
    assert "zero_optimization.stage=2" in err and "zero_optimization.stage=3" in err and "strategy=zero3" in err
    err = refused(tmp_path, "strategy=zero3_offload", "model=gpt_7b")
    assert "hardware.host_memory_gb" in err and "zero3_offload" in err
    err = refused(tmp_path, "strategy=zero1", "strategy.offload_params=true")
    assert "strategy.offload_params" in err


def test_user_deepspeed_json_passes_through(tmp_path):
    """Keys Loom does not set reach DeepSpeed; agreeing values are fine (no processes)."""
    from loom.pipeline import resolve
    from loom.strategies import layout_of
    from loom.strategies.deepspeed_config import resolved_deepspeed_config

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7},
                                "gradient_clipping": 1.0}))
    cfg = resolve(["strategy=zero3", f"strategy.deepspeed_config={user}", "dataset.batch_size=8"])
    ds = resolved_deepspeed_config(cfg, layout_of(cfg))
    # overlap_comm: Loom's default (strategies.deepspeed_config.PRECISION_DEFAULTS) fills the JSON's gap
    assert ds["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 5e7, "overlap_comm": True}
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
