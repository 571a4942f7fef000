"""Context parallelism (strategy.cp, Ulysses): spawned gloo ranks train Loom's GPT and Llama for 10 steps
under FSDP2 over (dp x cp) exactly as one process trains the same global batch, with and without
document packing; and, in process, what validation refuses. (The plan's figures: tests/test_plan_cp.py.)"""

from __future__ import annotations

import copy
import csv
import json
import os
from pathlib import Path

import pytest
import torch

# (family, network kwargs): GQA in the Llama (8 query heads, 4 key/value heads: cp 4 gets one of each)
NETS = {
    "gpt": dict(n_layer=2, n_head=4, d_model=32, vocab_size=64, block_size=64),
    "llama": dict(n_layer=2, n_head=8, n_kv_heads=4, d_model=32, intermediate_size=48, vocab_size=64,
                  block_size=64, rope_theta=10000.0),
    # moe_tiny's shape with its balance loss on: the routers see every token of the whole sequence
    "moe": dict(n_layer=2, n_head=4, n_kv_heads=2, head_dim=8, d_model=32, vocab_size=64, block_size=64,
                num_experts=4, experts_per_token=2, moe_intermediate_size=16, aux_loss_coef=0.01),
}
B, T, STEPS = 2, 32, 10
NETS_HF_LAYERS = 2  # attention modules of the transformers Llama (one per layer)


def network(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        from loom.models.gpt.network import GPT

        return GPT(**NETS["gpt"])
    if family == "moe":
        from loom.models.moe.network import MoETransformer

        return MoETransformer(**NETS["moe"])
    if family == "hf":  # transformers' own Llama, its attention routed through Loom's AttentionInterface entry
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    from loom.models.llama.network import Llama

    return Llama(**NETS["llama"])


def forward(net: torch.nn.Module, x: torch.Tensor, pos: torch.Tensor | None, cp=None) -> torch.Tensor:
    """Logits of Loom's networks (`context` set on them) or of a transformers model (`cp`: its slice)."""
    if hasattr(net, "config"):
        if cp is None:
            return net(input_ids=x, use_cache=False).logits
        from loom.models.hf import context

        return context.logits(net, x, cp)
    return net(x) if pos is None else net(x, pos)


def loss_of(net: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The step's loss plus a mixture of experts' balance loss of the forward just run."""
    aux = net.balance_loss() if hasattr(net, "balance_loss") else None
    return loss if aux is None else loss + aux


def tensor_parallel(net: torch.nn.Module, mesh) -> None:
    """The Llama family's own plan (loom.models.llama.module) on the mesh's tensor-parallel dim."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from loom.models.llama.module import LlamaModule

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for unit, plan in LlamaModule.tensor_parallel_plan.items():
        for sub in net.modules():
            if isinstance(sub, unit):
                parallelize_module(sub, mesh, {k: styles[v]() for k, v in plan.items()})


def global_batch(step: int, dp: int, documents: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(inputs, positions or None, targets) of dp x B sequences: with documents, 2-4 documents per
    sequence, positions restarting at 0 and no target across a boundary (the data's packing)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (dp * B, T + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    if not documents:
        return x, None, y
    pos = torch.zeros(dp * B, T, dtype=torch.long)
    for row in range(dp * B):
        cuts = sorted(torch.randperm(T - 2, generator=g)[: 1 + row % 3].add(1).tolist())
        start = 0
        for end in [*cuts, T]:
            pos[row, start:end] = torch.arange(end - start)
            if end < T:
                y[row, end - 1] = -100  # the last token of a document predicts nothing
            start = end
    return x, pos, y


def train_scenario(rank: int, world: int, cp: int, tp: int, family: str, documents: bool) -> dict:
    """One scenario on this rank: the network context-parallel over cp and FSDP2-sharded over dp x cp;
    rank 0 also trains an unsplit copy on the whole global batch. Rank 0 returns its losses, the
    unsplit copy's, and the largest relative gradient difference of each step (full gradients)."""
    from loom.data.batch import Batch
    from loom.layout import ParallelLayout
    from loom.models.context_parallel import ContextShard, apply_context_parallel, local_loss
    from loom.models.lit import batch_loss
    from loom.strategies.mesh import context_mesh
    from loom.strategies.model_parallel import shard_roots

    dp = world // (cp * tp)
    lay = ParallelLayout(world, world, 1, dp, tp, 1, cp=cp, cp_style="ulysses")
    mesh = context_mesh("cpu", lay)
    net = network(family)
    ref = copy.deepcopy(net) if rank == 0 else None
    if tp > 1:
        tensor_parallel(net, mesh["tensor_parallel"])
    if family == "hf":
        from loom.models.hf import context

        cp_mesh = mesh["cp"]
        shard = hf_cp = ContextShard(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
        assert context.apply(net, shard) == NETS_HF_LAYERS
    else:
        shard, hf_cp = apply_context_parallel(net, mesh["cp"], "ulysses"), None
    assert shard.rank == lay.cp_rank(rank), (shard.rank, lay.cp_rank(rank))
    units = tuple({type(b) for b in (net.blocks if family == "gpt" else net.model.layers)})
    shard_roots([net], units, mesh["data_parallel"], True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (net, ref) if m is not None]
    out: dict = {"losses": [], "ref_losses": [], "grad_gaps": []}
    mine = slice(lay.dp_rank(rank) * B, (lay.dp_rank(rank) + 1) * B)
    for step in range(STEPS):
        x, pos, y = global_batch(step, dp, documents)
        logits = forward(net, x[mine], None if pos is None else pos[mine], hf_cp)
        loss = loss_of(net, local_loss(logits, y[mine], shard, None, None))
        loss.backward()
        grads = [p.grad.full_tensor() for p in net.parameters()]  # a collective: every rank
        out["losses"].append(loss.item())
        if ref is not None:  # the unsplit model: each dp rank's own mean, averaged (Loom's dp semantics)
            per_rank = []
            for d in range(dp):
                rows = slice(d * B, (d + 1) * B)
                batch = Batch(inputs=x[rows], targets=y[rows], positions=None if pos is None else pos[rows])
                logits = forward(ref, x[rows], None if pos is None else pos[rows])
                per_rank.append(loss_of(ref, batch_loss(logits, batch)))
            torch.stack(per_rank).mean().backward()
            out["grad_gaps"].append(max((g - r.grad).abs().max().item() / max(r.grad.abs().max().item(), 1e-12)
                                        for g, r in zip(grads, ref.parameters(), strict=True)))
            out["ref_losses"].append(per_rank[0].item())
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return out


def worker(rank: int, world: int, scenarios: list, init_file: str, out_dir: str) -> None:
    """One rank of a gloo group running every scenario in turn; what each returned to out_dir/<rank>.pt."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = {tuple(sc): train_scenario(rank, world, *sc) for sc in scenarios}
        dist.destroy_process_group()
    except BaseException:  # report instead of leaving the other ranks to time out silently
        import traceback

        torch.save({"traceback": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        os._exit(1)
    torch.save(result, Path(out_dir) / f"{rank}.pt")


# (cp, tp, family, documents) per world size: one spawned group each runs its scenarios in turn
SCENARIOS = {
    2: [(2, 1, "gpt", True),       # GPT, packed documents: the mask of the whole sequence on every rank
        (2, 1, "moe", False),      # MoE: routing per token, the balance loss over whole sequences
        (2, 1, "hf", False)],      # transformers' Llama through its AttentionInterface, rotary at position_ids
    4: [(4, 1, "llama", False),    # Llama GQA at cp 4: two query heads and one key/value head per rank
        (2, 1, "llama", True),     # dp 2 x cp 2, documents: FSDP2 over both, each dp rank its own rows
        (2, 2, "llama", True)],    # cp 2 x tp 2: Ulysses over each tensor-parallel rank's heads
}


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_cp_ranks_train_as_one_process(tmp_path, world):
    """10 AdamW steps: rank 0's loss (the whole sequences', every cp rank's alike) and full gradients
    equal the unsplit model's on the same global batch within 1e-5 (fp32) at every step."""
    from conftest import spawn_ranks

    ranks = spawn_ranks(worker, (world, SCENARIOS[world], str(tmp_path / "init"), str(tmp_path)), world, tmp_path)
    for sc in SCENARIOS[world]:
        r = ranks[0][sc]
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (sc, r["losses"], r["ref_losses"])
        assert max(r["grad_gaps"]) <= 1e-5, (sc, r["grad_gaps"])
        assert ranks[sc[1]][sc]["losses"] == r["losses"], sc  # rank 0's cp peer: the same whole-sequence loss
        assert r["losses"][0] != r["losses"][-1], sc  # training happened


# --- one launch: `loom train strategy=fsdp strategy.cp=2` beside the shared Llama runs ---------------------

@pytest.mark.launch
def test_cp_run_follows_singles_curve_and_resumes_at_cp_1(shared, tmp_path):
    """The shared Llama import (tests/test_llama_runs.py) trained 5 steps under fsdp with cp 2 x dp 2
    on 4 ranks, then resumed in this process at cp 1 on one rank (states resharded from the DCP
    checkpoint) to 10: every step's loss is the shared `single` run's within 1e-5."""
    from conftest import resume_in_process, run_loom
    from test_llama_runs import completed_llama_runs, llama_args

    from loom.pipeline import resolve

    single = completed_llama_runs(shared, ["single"])["single"].losses()
    common = [a for a in llama_args(shared, "fsdp") if not a.startswith(("checkpoint.", "trainer.max_steps"))]
    both = [*common, "checkpoint.every_n_steps=5", "trainer.global_batch_size=8", "run.id=cp"]
    run = run_loom("train", *both, "hardware.devices=4", "strategy.cp=2", "trainer.max_steps=5", root=tmp_path)
    assert run.rc == 0, run.out[-3000:] + run.err[-3000:]
    log = (run.run_dir / "logs" / "rank-0.log").read_text()
    assert "context parallelism: each sequence split over cp=2 ranks (ulysses), this rank's chunks [0] of 2" in log
    summary = run.summary()
    assert summary["parallel"]["cp"] == 2 and summary["parallel"]["dp_shard"] == 2, summary["parallel"]
    plan = json.loads((run.run_dir / "plan.json").read_text())
    assert plan["parallel"]["cp"] == 2

    cfg = resolve([*both, "hardware.devices=1", "strategy.cp=1", "trainer.max_steps=10", f"run.root={tmp_path}"])
    resume_in_process(cfg, run.run_dir, "strategy.cp 2 -> 1")
    got = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(run.run_dir / "metrics.csv"))
           if r.get("train/loss")}
    assert sorted(got) == list(range(1, 11)), got
    off = {step: abs(got[step] - single[step]) / single[step] for step in got}
    assert max(off.values()) <= 1e-5, off


# --- refusals before launch -------------------------------------------------------------------------------

CPU = ["hardware=cpu", "strategy=fsdp", "trainer.max_steps=1", "tracking=csv"]


@pytest.mark.parametrize("args, says", [
    (["hardware.devices=2", "strategy.cp=2", "dataset.seq_len=127"],
     "dataset.seq_len=127: must be a multiple of 2"),
    (["model=llama_tiny", "hardware.devices=4", "strategy.cp=4", "model.n_head=4", "model.n_kv_heads=2",
      "model.d_model=64"], "must divide the 2 key/value heads (model.n_kv_heads=2)"),
    (["hardware.devices=2", "strategy.cp=2", "model.n_head=3", "model.d_model=96"],
     "must divide the 3 query heads (model.n_head=3)"),
    (["hardware.devices=2", "strategy.cp=2", "strategy.cp_style=ring"], "ring attention runs on CUDA only"),
    (["hardware.devices=2", "strategy.cp=2", "strategy.cp_style=spiral"], "strategy.cp_style='spiral'"),
    (["hardware.devices=2", "strategy.cp=0"], "strategy.cp=0: must be a positive integer"),
    (["hardware.devices=3", "strategy.cp=2"], "strategy.cp=2 must divide the world size 3"),
    (["model=moe_tiny", "hardware.devices=4", "strategy.cp=2", "strategy.ep=2", "model.aux_loss_coef=0"],
     "context parallelism is built beside FSDP2, tensor and pipeline parallelism so far"),
    (["strategy=nd", "hardware.devices=8", "strategy.dp_replicate=2", "strategy.dp_shard=2", "strategy.cp=2"],
     "use strategy.ep=1 and strategy.dp_replicate=1"),
])
def test_bad_context_parallel_configs_are_refused(tmp_path, args, says):
    from conftest import refused

    err = refused(tmp_path, *CPU, *args)
    assert says in err, err


def test_cp_on_a_strategy_without_it_names_the_ones_with_it(tmp_path):
    from conftest import refused

    err = refused(tmp_path, "hardware=cpu", "strategy=zero2", "hardware.devices=2", "strategy.cp=2")
    assert "unknown key strategy.cp=2" in err and "strategy=fsdp, fsdp_tp, nd" in err, err


@pytest.mark.parametrize("extra, says", [
    ({"sliding_window": 64}, "its sliding-window attention (sliding_window=64 < dataset.seq_len=128)"),
    ({}, "strategy.cp=4 = 4 must divide the 2 key/value heads (model.overrides.num_key_value_heads=2)"),
])
def test_a_transformers_model_is_refused_naming_why(tmp_path, extra, says):
    """A transformers decoder splits through its AttentionInterface unless its attention is more than
    causal SDPA (Mistral's sliding window), or its key/value heads do not divide."""
    from conftest import refused
    from transformers import MistralConfig

    MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, **extra).save_pretrained(tmp_path / "cfg")
    cp = 2 if extra else 4
    err = refused(tmp_path, *CPU, "model=hf_causal_lm", f"model.config={tmp_path / 'cfg'}",
                  f"hardware.devices={cp}", f"strategy.cp={cp}")
    assert says in err, err


def test_cp_layout_reads_one_batch_per_dp_rank():
    """cp ranks share a data-parallel rank (the same batch); FSDP2's group is dp x cp."""
    from loom.pipeline import resolve
    from loom.strategies import layout_of

    lay = layout_of(resolve(["hardware=cpu", "strategy=fsdp", "hardware.devices=8", "strategy.cp=4"]))
    assert (lay.dp, lay.cp, lay.dp_shard, lay.batch_sharers) == (2, 4, 2, 4)
    assert [lay.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.cp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    tp = layout_of(resolve(["hardware=cpu", "strategy=fsdp_tp", "hardware.devices=8", "strategy.tensor_parallel=2",
                            "strategy.cp=2", "model.n_head=4"]))
    assert (tp.dp, tp.cp, tp.tp) == (2, 2, 2)
    assert [tp.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert tp.parallel()["cp"] == 2 and tp.parallel()["cp_style"] == "ulysses"
