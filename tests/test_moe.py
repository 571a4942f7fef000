"""The MoE family in-process: its counts and shapes against the module, grouped matmul against the
per-expert loop, the router, the sequence-wise balance loss under gradient accumulation, the
aux-loss-free bias, and one in-process `fit` of moe_tiny (no launch)."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import FAST
from omegaconf import OmegaConf

from loom.models.moe import hf_config, spec
from loom.models.moe.network import Experts, MoETransformer, Router, sequence_balance_loss
from loom.pipeline import resolve

TINY = ["model=moe_tiny", *FAST]


def _network(**over) -> tuple[MoETransformer, object]:
    cfg = resolve([*TINY, *(f"model.{k}={v}" for k, v in over.items())])
    from loom.models.lit import network_kwargs

    torch.manual_seed(0)
    return MoETransformer(**network_kwargs(cfg.model)), cfg


@pytest.mark.parametrize("over", [{}, {"shared_intermediate_size": 48, "bias_update_rate": 0.01, "tie_embeddings": True},
                                  {"qk_norm": False, "n_kv_heads": 4}])
def test_shapes_and_counts_match_the_module(over):
    net, cfg = _network(**over)
    state = net.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == hf_config.moe_shapes(cfg.model)
    s = spec(cfg.model, 128)
    assert s.params == sum(v.numel() for v in state.values())
    m = cfg.model
    per_expert = 3 * m.d_model * m.moe_intermediate_size
    inactive = m.n_layer * (m.num_experts - m.experts_per_token) * per_expert
    assert s.active_params == s.params - inactive - (m.n_layer * m.num_experts if m.bias_update_rate else 0)


def test_qwen3_moe_30b_a3b_counts_are_the_published_ones():
    cfg = resolve(["model=qwen3_moe_30b_a3b", *FAST])
    s = spec(cfg.model, 4096)
    assert round(s.params / 1e9, 1) == 30.5  # Qwen3 technical report: 30.5B total, 3.3B activated
    assert 3.3e9 <= s.active_params < 3.4e9  # 3.35B with the embedding and head, "3.3B" as published


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_the_per_expert_loop(dtype):
    torch.manual_seed(1)
    grouped, loop = Experts(6, 32, 16, grouped_mm=True), Experts(6, 32, 16, grouped_mm=False)
    for e in (grouped, loop):
        e.to(dtype)
    with torch.no_grad():
        grouped.gate_up_proj.normal_(0, 0.1), grouped.down_proj.normal_(0, 0.1)
        loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([5, 0, 9, 1, 0, 7])  # experts without tokens included
    x = torch.randn(int(counts.sum()), 32, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = grouped(xa, counts), loop(xb, counts)
    out_a.sum().backward()  # a stride-0 gradient: what grouped matmul's backward refuses unmade contiguous
    out_b.sum().backward()
    assert torch.equal(out_a, out_b)
    assert torch.equal(xa.grad, xb.grad)
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(grouped, name).grad, getattr(loop, name).grad), name


def test_float64_falls_back_to_the_loop():
    e = Experts(4, 8, 8).double()
    with torch.no_grad():
        e.gate_up_proj.normal_(), e.down_proj.normal_()
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, 8, dtype=torch.float64)
    assert torch.allclose(e(x, counts), Experts._loop(x, counts, e.gate_up_proj, e.down_proj))


def test_router_softmax_sigmoid_and_the_bias_changes_the_choice_not_the_weights():
    torch.manual_seed(2)
    x = torch.randn(10, 16)
    soft = Router(8, 16, 2, "softmax", True, 1.0, correction_bias=True)
    with torch.no_grad():
        soft.weight.normal_()
    idx, w, scores = soft(x)
    assert torch.allclose(w.sum(-1), torch.ones(10))
    assert torch.equal(idx, scores.topk(2).indices)
    with torch.no_grad():
        soft.e_score_correction_bias[idx[0, 0]] = -10.0  # the first token's favourite, pushed out
    idx2, w2, _ = soft(x)
    assert idx[0, 0] not in idx2[0]
    assert torch.allclose(w2, scores.gather(-1, idx2) / scores.gather(-1, idx2).sum(-1, keepdim=True))
    sig = Router(8, 16, 2, "sigmoid", False, 2.5, correction_bias=False)
    sig.weight = soft.weight
    idx3, w3, s3 = sig(x)
    assert torch.allclose(w3, 2.5 * torch.sigmoid(x @ soft.weight.T).gather(-1, idx3))


def test_balance_loss_is_one_when_balanced_and_a_mean_over_sequences():
    E, k, T = 4, 2, 6
    top = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]])
    assert torch.allclose(sequence_balance_loss(torch.full((T, E), 0.25), top, 1), torch.tensor(1.0))
    torch.manual_seed(3)
    scores = torch.rand(4 * T, E).requires_grad_()
    top = torch.randint(0, E, (4 * T, k))
    whole = sequence_balance_loss(scores, top, 4)
    halves = [sequence_balance_loss(scores[i * 2 * T:(i + 1) * 2 * T], top[i * 2 * T:(i + 1) * 2 * T], 2)
              for i in range(2)]
    # gradient accumulation: the mean of the micro-batches' losses (each divided by 2) is the big batch's
    assert torch.allclose(whole, sum(halves) / 2)
    g_whole = torch.autograd.grad(whole, scores)[0]
    g_accum = torch.autograd.grad(sum(h / 2 for h in halves), scores)[0]
    assert torch.allclose(g_whole, g_accum)


def test_the_correction_bias_moves_against_the_load():
    net, _ = _network(bias_update_rate=0.1)
    loads = [torch.tensor([10, 0, 5, 5, 5, 5, 5, 5]) for _ in net.moe_blocks()]
    net.update_correction_bias(loads)
    bias = net.moe_blocks()[0].gate.e_score_correction_bias
    assert bias[0] == pytest.approx(-0.1) and bias[1] == pytest.approx(0.1) and bias[2] == 0.0


def test_moe_tiny_trains_in_process_with_accumulation_and_the_bias(tmp_path):
    """One `fit` in this process: the balance loss and expert-load metrics reach metrics.csv, the
    aux-loss-free bias moved, and the final weights are written."""
    from loom.freeze import freeze
    from loom.plan import make_plan
    from loom.rundir.config_file import load_frozen
    from loom.rundir.summary import read_summary
    from loom.worker.fit import fit

    cfg = resolve([*TINY, "strategy=single", "trainer.max_steps=4", "trainer.accumulate_grad_batches=2",
                   "dataset.batch_size=4", "dataset.seq_len=32", "model.bias_update_rate=0.01",
                   "trainer.limit_val_batches=1", f"run.root={tmp_path}", "run.id=moe"])
    run_dir = freeze(cfg, make_plan(cfg)).run_dir
    assert fit(load_frozen(run_dir / "config.yaml"), run_dir, 0) == 0
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    moe = summary["moe"]  # the last step's load over all ranks and micro-batches, 0 dropped (dropless)
    assert moe["dropped_tokens"] == 0 and moe["expert_load_max"] >= 1.0 >= moe["expert_load_min"] >= 0.0
    assert sum(moe["tokens_per_expert_last_step"]) == 2 * 8 * 32 * 2  # layers x tokens x micro-batches x top-2
    assert moe["worst_expert_load_max"] >= moe["expert_load_max"]
    by_layer = torch.tensor(moe["tokens_per_expert_by_layer_last_step"], dtype=torch.float64)  # [layers, experts]
    assert by_layer.sum(dim=0).tolist() == moe["tokens_per_expert_last_step"]  # the sum over layers ...
    ratios = by_layer / by_layer.mean(dim=1, keepdim=True)  # ... and max / min the worst layer's: both derivable
    assert (round(float(ratios.max()), 4), round(float(ratios.min()), 4)) == (moe["expert_load_max"], moe["expert_load_min"])
    assert set(moe["about"]) == set(moe) - {"about"}  # every figure says what it counts
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    seen = {k for r in rows for k, v in r.items() if v}
    assert {"train/moe_aux_loss", "moe/expert_load_max", "moe/expert_load_min"} <= seen
    loads = [float(r["moe/expert_load_max"]) for r in rows if r.get("moe/expert_load_max")]
    assert all(v >= 1.0 for v in loads)
    # a step's figures at that step: the load and the aux loss where train/loss is (they lagged by one)
    at = {k: sorted(int(r["step"]) for r in rows if r.get(k)) for k in ("train/loss", "moe/expert_load_max",
                                                                      "train/moe_aux_loss")}
    assert at["moe/expert_load_max"] == at["train/moe_aux_loss"] == at["train/loss"] == [1, 2, 3, 4], at
    from safetensors.torch import load_file

    final = load_file(str(run_dir / "final" / "model.safetensors"))
    bias = final["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # 4 updates of +-0.01 (2 micro-batches each)
    assert bias.abs().max() <= 4 * 0.01 + 1e-6  # at most one step of 0.01 per optimizer step
    assert OmegaConf.select(load_frozen(run_dir / "config.yaml"), "model.num_experts") == 8


def test_a_rank_reads_only_its_experts_from_a_per_expert_checkpoint(tmp_path):
    """FileInit filling rows [2, 4) of a fused expert weight (an expert-parallel rank's experts)
    from per-expert tensors reads those two experts only, and gets the fused layout's values."""
    from safetensors.torch import save_file

    from loom.models.init import FileInit
    from loom.models.moe.module import read_per_expert

    E, inner, d = 8, 4, 8
    torch.manual_seed(4)
    parts = {p: torch.randn(E, inner if p != "down" else d, d if p != "down" else inner) for p in ("gate", "up", "down")}
    tensors = {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": parts[p][e].contiguous()
               for e in range(E) for p in parts}
    save_file(tensors, str(tmp_path / "experts.safetensors"))
    init = FileInit(str(tmp_path / "experts.safetensors"), read_per_expert)
    fused = torch.cat([parts["gate"], parts["up"]], dim=1)  # [E, 2I, d]
    row = 2 * inner * d
    dest = torch.empty(2 * row)
    init.fill_flat(dest, "model.layers.0.mlp.experts.gate_up_proj", tuple(fused.shape), 2 * row)
    assert torch.equal(dest, fused[2:4].reshape(-1))
    assert init.elements_read == 2 * row  # two experts' gate and up, nothing else
    down = torch.empty(E * d * inner)
    init.fill_flat(down, "model.layers.0.mlp.experts.down_proj", (E, d, inner), 0)  # whole: every expert
    assert torch.equal(down, parts["down"].reshape(-1))
