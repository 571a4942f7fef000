"""Every parallelism strategy, for real: `loom train` on CPU processes (gloo, fp32).

One launch per strategy checks completion, a falling loss, the bytes each rank holds and the
step-1 loss against `single`. (Resuming each strategy, at the same world and at another one, is
test_resume.py's, test_elastic.py's and test_elastic_zero.py's.) Bad strategy input must fail in
validation (exit 2, no run dir). Each parity run also carries a README option (conftest.PROCS:
a ddp comm hook, fsdp's reshard_after_forward=false, zero3's activation checkpointing and bf16
export, zero3_offload's offload_params), whose effect is asserted here while its curve still
matches `single`.

Why step-1 losses must agree: every strategy builds the same model from the same seed before
any sharding, and the samples match. Loom's sampler (data/sampler.py) deals the epoch's seeded
global order by micro batch: at 2 ranks with micro batch B, step k is order[2kB:(2k+2)B] split
between the ranks, and `single` at batch 2B reads the same 2B windows (checked below through
the data module, without processes). The logged loss is the mean over ranks of equal-size batch means,
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

    from loom.models.gpt import spec as gpt_spec

    m = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "gpt_tiny.yaml")
    return gpt_spec(m, 64).params


@pytest.fixture(scope="module")
def runs(strategy_runs) -> dict:
    return strategy_runs


def _first_batches(dp: int, micro: int, steps: int) -> list[list[int]]:
    """The sample ids of each of the first `steps` optimizer steps, all ranks together, through
    Loom's data module configured as the worker configures it (LoomDataModule(cfg, dp_rank,
    dp_size).train_dataloader(), ResumableDistributedSampler inside)."""
    from tests_helpers import IdSamples

    from loom.data.module import LoomDataModule
    from loom.pipeline import resolve

    cfg = resolve(["hardware=cpu", "model=gpt_tiny", f"dataset.batch_size={micro}", "hardware.dataloader_workers=0"])
    per_rank = []
    for rank in range(dp):
        dm = LoomDataModule(cfg, dp_rank=rank, dp_size=dp)
        dm.train_set = IdSamples(1001)
        loader = iter(dm.train_dataloader())
        per_rank.append([next(loader).inputs.tolist() for _ in range(steps)])
    return [sorted(x for r in per_rank for x in r[k]) for k in range(steps)]


def test_loom_sampler_gives_every_rank_its_part_of_single_batch():
    """Step k of a 2-rank run at micro batch B reads the very samples of `single`'s step k at
    batch 2B (the premise of every loss comparison below), and the ranks' halves differ."""
    single, two = _first_batches(1, 2 * B, 3), _first_batches(2, B, 3)
    assert two == single
    assert len(set(single[0])) == 2 * B and single[0] != single[1]


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


def _log(r, rank: int = 0) -> str:
    return (r.run_dir / "logs" / f"rank-{rank}.log").read_text()


def test_readme_options_carried_by_the_parity_runs_take_effect(runs):
    """conftest.PROCS: each option's effect, on runs whose curves match `single` above."""
    # ddp: the bf16 gradient-compression hook is registered (Lightning alone would skip it on CPU)
    assert "ddp comm hook bf16_compress_hook_gloo registered on cpu" in _log(runs["ddp"])
    # fsdp: FSDP2's own parameter groups keep the gathered block parameters for backward;
    # fsdp_tp (the default) reshards them
    assert "fsdp: 2 unit(s) sharded, 2 keep their parameters gathered, 0 reshard them" in _log(runs["fsdp"])
    assert "fsdp: 2 unit(s) sharded, 0 keep their parameters gathered, 2 reshard them" in _log(runs["fsdp_tp"])
    # zero3_offload: the ZeRO-3 optimizer offloads the parameter partitions too; zero3 offloads nothing
    for rank in (0, 1):
        assert "zero3: parameter partitions offloaded: True, optimizer states offloaded: True" in \
            _log(runs["zero3_offload"], rank)
        assert "zero3: parameter partitions offloaded: False, optimizer states offloaded: False" in \
            _log(runs["zero3"], rank)
    # zero3: both blocks are checkpointed (the recompute is the same math: its curve matched single's)
    assert "activation checkpointing (full): 2 of" in _log(runs["zero3"])


def test_sharded_export_dtype_bf16_loads_into_the_model(runs):
    """checkpoint.export_dtype=bf16 under zero3 (gathered from partitions): every floating tensor
    of final/model.safetensors is bf16, equals single's final weights to bf16 rounding, and the
    file loads into a fresh gpt_tiny."""
    import torch
    from safetensors.torch import load_file

    from loom.models import build_module
    from loom.pipeline import resolve

    got = load_file(str(runs["zero3"].run_dir / "final" / "model.safetensors"))
    ref = load_file(str(runs["single"].run_dir / "final" / "model.safetensors"))
    assert {v.dtype for v in got.values()} == {torch.bfloat16}
    assert {v.dtype for v in ref.values()} == {torch.float32}
    for k in ref:
        torch.testing.assert_close(got[k].float(), ref[k], rtol=1e-2, atol=1e-3)
    module = build_module(resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1"]))
    module.configure_model()
    module.model.load_state_dict({k: v.float() for k, v in got.items()}, strict=True)


# ----------------------------------------------------------------------------- bad input


def test_bad_strategy_input_fails_fast(loom, tmp_path):
    err = refused(tmp_path, "strategy=fsdp_tp", "hardware.devices=4", "strategy.tensor_parallel=3")
    assert "strategy.tensor_parallel=3" in err and "hardware.devices=4" in err and "1, 2, 4" in err
    err = refused(tmp_path, "strategy=ddp", "strategy.comm_hook=zip")
    assert "strategy.comm_hook='zip'" in err and "powersgd" in err
    from loom.strategies.ddp import HOOK_BUILDERS
    from loom.strategies.schema import COMM_HOOKS

    assert set(HOOK_BUILDERS) == set(COMM_HOOKS) - {None}  # every valid name builds a hook, no other does
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
