"""float8 training through torchao (float8=tensorwise|rowwise|rowwise_with_gw_hp|mxfp8), emulated on CPU:
every recipe converts a tiny Llama (by type; what stays in high precision, and why) and trains it near
the float32 run's losses; spawned gloo ranks train it under DDP and under FSDP2 with float8
all-gather as one process does; in process, a run through Loom's own `fit` writes summary.json's
`float8`, resumes bit-identically from its checkpoint (which loads with weights_only=True), exports
the high-precision weights under a float8=none run's names, and resumes with float8 switched off.
(The checks, the plan and the MFU against the float8 peak are the torch-free half's tests.)"""

from __future__ import annotations

import csv
import json
import os
import traceback
from pathlib import Path

import pytest
import torch
from conftest import FAST, killed_copy, resume_in_process, spawn_ranks
from omegaconf import OmegaConf

pytest.importorskip("torchao")

# head_dim 16, q/o 64x64, k/v 64x32, MLP 64x96: every dimension divisible by 32 (mxfp8's block) and 16
NET = dict(n_layer=2, n_head=4, n_kv_heads=2, d_model=64, intermediate_size=96, vocab_size=64, block_size=32,
           rope_theta=10000.0, tie_embeddings=False)
B, T = 4, 32
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
CONVERTED = [f"model.layers.{i}.{m}" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def float8_cfg(recipe: str, **options):
    node = {"name": recipe, "all_gather": False, "skip": ["lm_head", "score"], "auto_filter": False,
            "emulate": None, **options}
    return OmegaConf.create({"float8": node})


def network(meta: bool = False, **kwargs) -> torch.nn.Module:
    from loom.models.llama.network import Llama

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return Llama(**{**NET, **kwargs})
    return Llama(**{**NET, **kwargs})


def batches(steps: int, rows: int = B, seed: int = 1) -> list[torch.Tensor]:
    """Two random batches in turn: a net that trains memorizes them (the loss falls well below ln 64)."""
    g = torch.Generator().manual_seed(seed)
    two = [torch.randint(0, NET["vocab_size"], (rows, T + 1), generator=g) for _ in range(2)]
    return [two[i % 2] for i in range(steps)]


def train(net: torch.nn.Module, data: list[torch.Tensor], after_step=None) -> list[float]:
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for xy in data:
        logits = net(xy[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(net)
        losses.append(loss.item())
    return losses


def float8_types(recipe: str):
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

        return MXFP8TrainingWeightWrapperTensor
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def is_converted(recipe: str, module: torch.nn.Module) -> bool:
    kind = float8_types(recipe)
    if recipe == "mxfp8":
        return isinstance(module.weight.data, kind) or isinstance(module.weight, kind)
    return isinstance(module, kind)


# Emulated float8 rounds each matmul's operands to e4m3 (3 mantissa bits: steps of 6-12%) with one
# scale per tensor (tensorwise), per row (rowwise) or per 32-element block (mxfp8); the gradients
# are e5m2 or e4m3 too, except rowwise_with_gw_hp's weight gradient. Measured here over 20 AdamW steps
# (lr 3e-3) memorizing two batches (float32: 4.17 -> 2.03), the largest |float8 - float32| / float32
# per step: tensorwise 3.2%, rowwise_with_gw_hp 2.8%, mxfp8 0.5%, rowwise 0.3% (the differences
# grow as the two runs' weights drift apart; the first step's forward differs by < 0.01). 5% per
# step holds every recipe with room for another BLAS's sums, and still fails a conversion that
# computes something else (a lost scale or a dropped bias is off by far more from the first step).
LOSS_RTOL = 0.05
FIRST_STEP_ATOL = 0.01
STEPS = 20


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_converts_and_trains_near_the_float32_losses(recipe):
    from loom.float8.convert import Float8Conversion

    data = batches(STEPS)
    reference = train(network(), data)
    net = network()
    conv = Float8Conversion(float8_cfg(recipe))
    conv.convert(net, torch.device("cpu"), fsdp2=False)
    modules = dict(net.named_modules())
    assert conv.emulated is True and conv.all_gather is False
    assert conv.converted == CONVERTED
    assert all(is_converted(recipe, modules[n]) for n in CONVERTED)
    assert conv.skipped == {"lm_head": "float8.skip"} and not is_converted(recipe, modules["lm_head"])
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in network().named_parameters()]
    losses = train(net, data)
    worst = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
    assert worst < LOSS_RTOL and abs(losses[0] - reference[0]) < FIRST_STEP_ATOL, (worst, losses, reference)
    assert losses[-1] < reference[0] - 1.0  # it learned


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_filter_keeps_the_head_odd_shapes_and_small_layers_in_high_precision(recipe):
    """On the meta device (where Loom converts): the names and reasons of what stays in high precision."""
    from loom.float8.convert import Float8Conversion

    net = network(meta=True, intermediate_size=40)  # 64x40: not divisible by 16 (nor by mxfp8's 32)
    conv = Float8Conversion(float8_cfg(recipe))
    conv.convert(net, torch.device("cpu"), fsdp2=False)
    multiple = 32 if recipe == "mxfp8" else 16
    assert conv.skipped["lm_head"] == "float8.skip"
    assert conv.skipped["model.layers.0.mlp.gate_proj"] == f"in/out features 64x40 not divisible by {multiple}"
    assert conv.skipped["model.layers.1.mlp.down_proj"] == f"in/out features 40x64 not divisible by {multiple}"
    assert len(conv.converted) == 8 and all(".self_attn." in n for n in conv.converted)
    assert all(p.is_meta for p in net.parameters())
    # auto_filter (torchtitan's auto_filter_small_kn): every layer of a tiny model is too small to gain
    auto = Float8Conversion(float8_cfg(recipe, auto_filter=True))
    auto.convert(network(meta=True), torch.device("cpu"), fsdp2=False)
    if recipe == "mxfp8":  # no size rule for MX (torchao has none): the shapes alone decide
        assert len(auto.converted) == 14
    else:
        assert auto.converted == [] and set(auto.skipped.values()) == {"float8.skip", "auto_filter: too small to gain"}


def test_mxfp8_keeps_layers_with_a_bias():
    """torchao 0.18's MX linear drops the bias: such layers stay in high precision."""
    from loom.float8.convert import Float8Conversion

    conv = Float8Conversion(float8_cfg("mxfp8"))
    conv.convert(network(meta=True, qkv_bias=True), torch.device("cpu"), fsdp2=False)
    assert conv.skipped["model.layers.0.self_attn.q_proj"] == "bias (torchao's MX linear drops it)"
    assert "model.layers.0.self_attn.o_proj" in conv.converted


# --- ddp and fsdp on spawned gloo ranks ---------------------------------------------------------------

PAR_STEPS = 6


def _ranks(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    out = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        data = [b.chunk(world)[rank] for b in batches(PAR_STEPS, rows=B * world, seed=2)]
        out["ddp"] = _ddp(data)
        out["fsdp"], out["fsdp_all_gather"] = _fsdp(data, world)
    except Exception:
        out["traceback"] = traceback.format_exc()
    finally:
        torch.save(out, Path(out_dir) / f"{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def _built(fsdp2: bool, recipe: str = "tensorwise", **options):
    """Loom's order (loom.models.construct): built on meta, converted, (sharded), materialized by name."""
    from loom.float8.convert import Float8Conversion
    from loom.models.init import NamedInit
    from loom.models.llama.module import llama_rule

    meta = network(meta=True)
    init = NamedInit(0, llama_rule())  # the Llama family's own: each parameter drawn by its name
    conv = Float8Conversion(float8_cfg(recipe, **options))
    conv.convert(meta, torch.device("cpu"), fsdp2=fsdp2)
    return meta, init, conv


def _ddp(data) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    from loom.models.init import materialize

    net, init, conv = _built(fsdp2=False)
    materialize(net, torch.device("cpu"), init)
    return _global(train(DistributedDataParallel(net), data))


def _fsdp(data, world: int) -> tuple[list[float], dict]:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from loom.models.init import materialize

    results = []
    for all_gather in (False, True):
        net, init, conv = _built(fsdp2=True, all_gather=all_gather)
        for layer in net.model.layers:
            fully_shard(layer)
        fully_shard(net)
        materialize(net, torch.device("cpu"), init)
        wrapped = isinstance(net.model.layers[0].self_attn.q_proj.weight.to_local(), WeightWithDynamicFloat8CastTensor)
        results.append((_global(train(net, data, after_step=conv.after_optimizer_step)), conv.all_gather, wrapped))
    return results[0][0], {"losses": results[1][0], "all_gather": results[1][1], "wrapped": results[1][2]}


def _global(losses: list[float]) -> list[float]:
    """Each step's loss over the whole global batch (every rank's shard has as many tokens)."""
    import torch.distributed as dist

    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def test_ddp_and_fsdp_with_float8_all_gather_train_as_one_process(tmp_path):
    """2 gloo ranks, tensorwise: DDP, FSDP2, and FSDP2 all-gathering float8 weights (scales
    precomputed after each step) train alike. Each rank scales its own activations and output
    gradients (tensorwise: one amax over its half of the batch), the same in the three layouts; the
    weights' scales are the whole weight's in all three (FSDP2's float8 all-gather scales by an
    all-reduced amax). So the three agree to the gradient reduction order (1e-4 on a loss of ~4;
    seen bit for bit here),
    and they differ from one process (whose amax spans the whole batch) as float8 runs do (1%)."""
    from socket import socket

    from loom.models.init import materialize

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = spawn_ranks(_ranks, (2, port, str(tmp_path)), nprocs=2, out_dir=tmp_path)
    net, init, conv = _built(fsdp2=False)
    materialize(net, torch.device("cpu"), init)
    one = train(net, batches(PAR_STEPS, rows=2 * B, seed=2))
    r0 = ranks[0]
    assert all("traceback" not in r for r in ranks), "\n".join(r.get("traceback", "") for r in ranks)
    assert r0["fsdp_all_gather"]["all_gather"] and r0["fsdp_all_gather"]["wrapped"]
    ddp, fsdp, gathered = r0["ddp"], r0["fsdp"], r0["fsdp_all_gather"]["losses"]
    for name, losses in (("fsdp", fsdp), ("fsdp float8 all-gather", gathered)):
        assert max(abs(a - b) for a, b in zip(losses, ddp, strict=True)) < 1e-4, (name, losses, ddp)
    assert max(abs(a - b) / b for a, b in zip(ddp, one, strict=True)) < 0.01, (ddp, one)


# --- Loom's own fit, in process -------------------------------------------------------------------

FIT = ["model=llama_tiny", "strategy=single", "hardware=cpu", *FAST, "trainer.max_steps=4",
       "checkpoint.every_n_steps=2", "trainer.limit_val_batches=0", "model.tie_embeddings=false",
       "run.id=f8"]
F8 = ["float8=tensorwise", "float8.auto_filter=false"]  # llama_tiny's layers are too small for auto_filter


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(run_dir / "metrics.csv"))
            if r.get("train/loss")}


def test_a_float8_run_resumes_bit_identically_and_switches_float8_off(tmp_path, caplog):
    import logging

    import torch.distributed as dist
    from safetensors.torch import load_file

    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan
    from loom.rundir.config_file import load_frozen
    from loom.worker.fit import fit

    root, root2, root3 = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    cfg = resolve([*FIT, *F8, f"run.root={root}"])
    run_dir = freeze(cfg, make_plan(cfg)).run_dir
    try:
        with caplog.at_level(logging.INFO, logger="loom"):
            assert fit(load_frozen(run_dir / "config.yaml"), run_dir, 0) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    summary = json.loads((run_dir / "summary.json").read_text())
    f8 = summary["float8"]
    assert f8["recipe"] == "tensorwise" and f8["emulated"] is True and f8["all_gather"] is False
    assert f8["converted"] == 14 and f8["skipped"] == {"lm_head": "float8.skip"}
    log = caplog.text
    assert "float8 tensorwise (emulated): 14 Linear layer(s) converted; kept in high precision: lm_head" in log

    # the checkpoint holds plain tensors under the plain names; loads with weights_only=True
    ckpt = torch.load(run_dir / "checkpoints" / "step-0000002.ckpt", weights_only=True)["state_dict"]
    assert all(type(t) is torch.Tensor for t in ckpt.values())
    # final weights: the high-precision tensors, named as a float8=none run's (the network's own names)
    from loom import models

    final = load_file(run_dir / "final" / "model.safetensors")
    plain = models.build_module(resolve([*FIT, f"run.root={root}"])).build_model().state_dict()  # float8=none
    assert set(final) == set(plain), set(final) ^ set(plain)

    # killed after step 2: resumed, steps 3 and 4 are those of the uninterrupted run, bit for bit
    copy = killed_copy(run_dir, root, root2)
    resumed = resolve([*FIT, *F8, f"run.root={root2}"])
    assert freeze(resumed, make_plan(resumed)).state == "resume"
    try:
        assert fit(load_frozen(copy / "config.yaml"), copy, 0) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert _losses(copy) == _losses(run_dir)
    assert all(torch.equal(final[k], t) for k, t in load_file(copy / "final" / "model.safetensors").items())

    # and switched off at resume: the same checkpoint continues in high precision
    off = killed_copy(run_dir, root, root3)
    resume_in_process(resolve([*FIT, "float8=none", f"run.root={root3}"]), off, "float8 tensorwise -> none from step 2 (the checkpoint's high-precision weights, trained on in high precision)")
    assert load_frozen(off / "config.yaml").float8.name == "none"
    after = _losses(off)
    assert [after[s] for s in (1, 2)] == [_losses(run_dir)[s] for s in (1, 2)]
    assert "float8" not in json.loads((off / "summary.json").read_text())


def test_fsdp2_with_float8_all_gather_checkpoints_and_resumes_bit_identically(tmp_path):
    """strategy=fsdp on one rank, in process: the weights FSDP2 shards are torchao's float8
    all-gather wrappers; its DCP checkpoint resumes bit for bit and final/ holds plain tensors."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan
    from loom.rundir.config_file import load_frozen
    from loom.worker.fit import fit

    args = [*FIT, *F8, "strategy=fsdp", "hardware.devices=1"]

    def run(root: Path) -> Path:
        cfg = resolve([*args, f"run.root={root}"])
        run_dir = freeze(cfg, make_plan(cfg)).run_dir
        try:
            assert fit(load_frozen(run_dir / "config.yaml"), run_dir, 0) == 0
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return run_dir

    run_dir = run(tmp_path / "a")
    f8 = json.loads((run_dir / "summary.json").read_text())["float8"]
    assert f8["all_gather"] is True and f8["converted"] == 14
    final = load_file(run_dir / "final" / "model.safetensors")
    assert all(type(t) is torch.Tensor for t in final.values())
    killed_copy(run_dir, tmp_path / "a", tmp_path / "b")
    copy = run(tmp_path / "b")
    assert _losses(copy) == _losses(run_dir)
    assert all(torch.equal(final[k], t) for k, t in load_file(copy / "final" / "model.safetensors").items())
