"""Mixed precision: one mechanism per strategy, DeepSpeed's precision defaults, clipping with
no host sync, and bf16-mixed training on CPU under every strategy.

Fast tests need no processes: the Trainer's precision per strategy, the resolved DeepSpeed
JSON, the `loom plan` row, the refusals, and `_clip_grad_by_norm` against torch's
`clip_grad_norm_` (plain tensors, and DTensors on two meshes of a 1-rank gloo group). The slow
ones start one short bf16-mixed run per precision path (plus fsdp in bf16-true) and read the
run dirs: completion, a finite falling loss, the precision each rank logged, the plan's
DeepSpeed keys, and the bytes each rank holds. fsdp and fsdp_tp are one implementation (one
`parallelize`, one MixedPrecisionPolicy): fsdp_tp's run covers both, its parameter bytes
compared with its fp32 parity run's. The ddp run also carries the powersgd comm hook (README):
step 1 is before any compression, later steps compress rank-1 (start_powerSGD_iter=2).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import FAST, launching_fixture, run_loom
from omegaconf import OmegaConf

from loom.errors import ConfigError
from loom.pipeline import resolve
from loom.plan.render import _deepspeed_precision
from loom.strategies import layout_of, lightning_precision
from loom.strategies.deepspeed_config import resolved_deepspeed_config
from loom.strategies.model_parallel import _clip_grad_by_norm

ZERO = ["zero1", "zero2", "zero3", "zero3_offload"]
# zero3_offload trains bf16 through the same DeepSpeed engine path as zero3 (its defaults: test above)
BF16_STRATEGIES = ["single", "ddp", "fsdp_tp", "pp", "zero1", "zero2", "zero3"]


def _cfg(strategy: str, precision: str):
    return OmegaConf.create({"strategy": {"name": strategy}, "hardware": {"precision": precision}})


@pytest.mark.parametrize("strategy,precision,expected", [
    ("fsdp", "bf16-mixed", "32-true"),        # FSDP2's MixedPrecisionPolicy casts: no autocast on top
    ("fsdp_tp", "bf16-mixed", "32-true"),
    ("fsdp", "bf16-true", "bf16-true"),       # Lightning's HalfPrecision casts the parameters
    ("fsdp", "32-true", "32-true"),
    ("ddp", "bf16-mixed", "bf16-mixed"),      # autocast
    ("single", "bf16-mixed", "bf16-mixed"),
    ("zero2", "bf16-mixed", "bf16-mixed"),    # Lightning's DeepSpeedPrecision: the engine casts
])
def test_trainer_precision_is_one_mechanism(strategy, precision, expected):
    assert lightning_precision(_cfg(strategy, precision)) == expected


def _resolved_ds(overrides: list[str]) -> dict:
    cfg = resolve(overrides)
    return resolved_deepspeed_config(cfg, layout_of(cfg))


def test_deepspeed_precision_defaults(tmp_path):
    """overlap_comm and fp32 reduction/accumulation by default; the user's JSON may override them."""
    for strategy in ZERO:
        ds = _resolved_ds([f"strategy={strategy}", "hardware=cpu", "hardware.precision=bf16-mixed"])
        assert ds["zero_optimization"]["overlap_comm"] is True
        assert ds["communication_data_type"] == "fp32"
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
        assert ds["bf16"] == {"enabled": True}
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}, "communication_data_type": "bf16",
                                "data_types": {"grad_accum_dtype": "bf16"}}))
    ds = _resolved_ds(["strategy=zero2", "hardware=cpu", "hardware.precision=bf16-mixed",
                       f"strategy.deepspeed_config={user}"])
    assert ds["zero_optimization"] == {"overlap_comm": False, "stage": 2}
    assert ds["communication_data_type"] == "bf16" and ds["data_types"] == {"grad_accum_dtype": "bf16"}
    row = _deepspeed_precision(ds)
    assert "overlap_comm false" in row and "communication bf16" in row and "grad accumulation bf16" in row


def test_plan_row_shows_resolved_deepspeed_precision():
    ds = _resolved_ds(["strategy=zero3", "hardware=cpu", "hardware.precision=bf16-mixed"])
    assert _deepspeed_precision(ds) == ("ZeRO-3, bf16 model, overlap_comm true, communication fp32, "
                                        "grad accumulation fp32")
    # A key left null is DeepSpeed's own default: the model dtype; overlap_comm only at stage 3.
    assert _deepspeed_precision({"zero_optimization": {"stage": 1, "overlap_comm": None},
                                 "bf16": {"enabled": True}, "communication_data_type": None}) == (
        "ZeRO-1, bf16 model, overlap_comm false, communication bf16, grad accumulation bf16")


@pytest.mark.parametrize("overrides,words", [
    (["strategy=fsdp", "hardware.precision=16-mixed"], ["strategy=fsdp", "bf16-mixed", "gradient scaler"]),
    (["strategy=zero2", "hardware=cpu", "hardware.precision=16-mixed"], ["DeepSpeed's CPU accelerator", "fp16"]),
])
def test_unsupported_precision_is_refused_clearly(overrides, words):
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    assert "hardware.precision='16-mixed'" in str(e.value)
    for w in words:
        assert w in str(e.value)


def _grads(seed: int, scale: float, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale).to(dtype) for shape in [(7, 5), (5,), (3, 4, 2), (1,)]]


def _optimizer(grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("scale,max_norm", [(1.0, 1.0), (1.0, 100.0), (10.0, 0.5)])
def test_clipping_matches_torch_on_plain_tensors(scale, max_norm):
    grads = _grads(0, scale)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, max_norm)
    opt = _optimizer(grads)
    _clip_grad_by_norm(opt, max_norm)
    for p, r in zip(opt.param_groups[0]["params"], ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_clipping_never_reads_a_value_on_the_host():
    """Meta tensors have no data: any .item()/float() of the norm (a host sync on GPU) raises."""
    grads = [torch.empty(s, device="meta") for s in [(7, 5), (5,), (300,)]]
    _clip_grad_by_norm(_optimizer(grads), 1.0)
    with pytest.raises((RuntimeError, NotImplementedError)):
        float(torch.linalg.vector_norm(grads[0]))  # what the old code did


def test_clipping_bf16_gradients_stay_bf16():
    grads = _grads(1, 10.0, torch.bfloat16)
    opt = _optimizer(grads)
    _clip_grad_by_norm(opt, 1.0)
    out = [p.grad for p in opt.param_groups[0]["params"]]
    assert all(g.dtype == torch.bfloat16 for g in out)
    assert abs(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in out])) - 1) < 0.02


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_clipping_dtensors_on_two_meshes(one_rank_group):
    """As fsdp_tp: TP-split weights on the 2-D mesh, the rest on its data-parallel dim. Each
    gradient, DTensor or not, is scaled like torch's clip_grad_norm_ scales the plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    dp = mesh["data_parallel"]
    grads = _grads(2, 10.0)
    placed = [distribute_tensor(grads[0], mesh, [Shard(0), Shard(1)]),
              distribute_tensor(grads[1], mesh, [Shard(0), Replicate()]),
              distribute_tensor(grads[2], dp, [Shard(0)]),
              distribute_tensor(grads[3], dp, [Replicate()])]
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), d.device_mesh, d.placements))
              for g, d in zip(grads, placed, strict=True)]
    for p, d in zip(params, placed, strict=True):
        p.grad = d
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    _clip_grad_by_norm(torch.optim.SGD(params, lr=0.1), 1.0)
    for p, r in zip(params, ref, strict=True):
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)


# ---- real processes: one short bf16-mixed run per strategy --------------------------------

STEPS = 4
COMMON = [*FAST, f"trainer.max_steps={STEPS}", "dataset.batch_size=4", "dataset.seq_len=64", "hardware=cpu"]
EXTRA = {"single": ["hardware.devices=1", "dataset.batch_size=8"],
         "ddp": ["strategy.comm_hook=powersgd"],
         "fsdp_tp": ["hardware.devices=4", "strategy.tensor_parallel=2"],
         "pp": ["hardware.devices=2", "dataset.batch_size=8"]}  # one data-parallel rank: the global batch


@launching_fixture(scope="session")
def bf16_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for s in BF16_STRATEGIES:
        out[s] = run_loom("train", f"strategy={s}", *COMMON, "hardware.precision=bf16-mixed",
                          *EXTRA.get(s, []), root=root)
    out["fsdp_bf16_true"] = run_loom("train", "strategy=fsdp", *COMMON, "hardware.precision=bf16-true", root=root)
    return out


def _rank0_log(r) -> str:
    return (r.run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [*BF16_STRATEGIES, "fsdp_bf16_true"])
def test_bf16_trains_on_cpu(bf16_runs, strategy):
    r = bf16_runs[strategy]
    assert r.rc == 0, r.out + r.err
    assert r.summary()["status"] == "completed"
    losses = r.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 0.2, losses
    # Same model, seed and samples as ddp: bf16 rounding moves the first loss by ~1%, not more.
    ref = bf16_runs["ddp"].losses()[1]
    assert abs(losses[1] - ref) < 0.03 * ref, (losses[1], ref)


@pytest.mark.slow
def test_pp_bf16_matches_single(bf16_runs):
    """strategy=pp trains under Lightning's bf16 autocast (the schedule's forward and backward run
    inside training_step): on the same 8 samples its step-1 loss is single's bf16 one (the same
    autocast forward, microbatch by microbatch; fp32 differs by ~4e-5 here), and after 4 steps
    the bf16 gradients summed over 2 microbatches instead of one batch may move it by ~1e-4."""
    pp, single = bf16_runs["pp"].losses(), bf16_runs["single"].losses()
    assert abs(pp[1] - single[1]) < 1e-5, (pp[1], single[1])
    assert abs(pp[STEPS] - single[STEPS]) < 1e-3, (pp[STEPS], single[STEPS])
    assert "Using bfloat16 Automatic Mixed Precision" in _rank0_log(bf16_runs["pp"])


@pytest.mark.slow
def test_fsdp_casts_with_its_policy_and_no_autocast(bf16_runs, strategy_runs):
    r = bf16_runs["fsdp_tp"]
    log = _rank0_log(r)
    assert "precision bf16-mixed: FSDP2 MixedPrecisionPolicy(param=bf16, reduce=fp32)" in log
    # The first Linear of the first Block (tensor-parallel) computes in bf16.
    assert "first forward: Linear weight torch.bfloat16, input torch.bfloat16, autocast off" in log
    # The sharded parameters FSDP2 keeps (and steps) stay fp32: the bytes of the fp32 parity run.
    params = r.summary()["memory"]["param_bytes_per_rank"]
    assert params == strategy_runs["fsdp_tp"].summary()["memory"]["param_bytes_per_rank"], params


@pytest.mark.slow
def test_ddp_powersgd_hook_registers_and_trains_in_bf16(bf16_runs):
    for rank in (0, 1):
        log = (bf16_runs["ddp"].run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert "ddp comm hook powerSGD_hook registered on cpu" in log


@pytest.mark.slow
def test_fsdp_bf16_true_keeps_bf16_parameters(bf16_runs):
    r = bf16_runs["fsdp_bf16_true"]
    assert "parameters and optimizer states in bf16 (Lightning HalfPrecision)" in _rank0_log(r)
    n = json.loads((r.run_dir / "plan.json").read_text())["params"]
    assert all(abs(b - 2 * n / 2) < 0.02 * b for b in r.summary()["memory"]["param_bytes_per_rank"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_plan_has_the_precision_defaults(bf16_runs, strategy):
    r = bf16_runs[strategy]
    ds = json.loads((r.run_dir / "plan.json").read_text())["deepspeed_config"]
    assert ds["zero_optimization"]["overlap_comm"] is True and ds["bf16"]["enabled"] is True
    assert ds["communication_data_type"] == "fp32" and ds["data_types"]["grad_accum_dtype"] == "fp32"
    if strategy == "zero1":
        # bf16 + fp32 accumulation at stage 1 is DeepSpeed's BF16_Optimizer: its fp32 master
        # partition plus Adam's m and v are still 12 bytes per parameter / 2 ranks.
        n = json.loads((r.run_dir / "plan.json").read_text())["params"]
        optim = r.summary()["memory"]["optim_state_bytes_per_rank"]
        assert all(abs(b - 12 * n / 2) < 0.02 * b for b in optim), (optim, n)
