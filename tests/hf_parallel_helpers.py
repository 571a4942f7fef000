"""Tiny transformers decoders and the training runs that tests/test_hf_parallel.py compares.

One reference per architecture (single process, float64) and, in 4 spawned gloo ranks, the same
steps under tensor parallelism (with gradient accumulation), dp x tp with FSDP2, and pipeline
parallelism (1F1B over 2 stages; interleaved 1F1B over 4 stages on 2 ranks). Every mode sees the
same global batch and loss (the mean token cross-entropy), so its per-step losses and final
weights must equal the reference's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from loom.models.hf import parallel as hf_parallel

VOCAB, SEQ, BATCH, STEPS, LR = 96, 16, 4, 10, 1e-3
ARCHS = ("llama", "qwen3", "mistral", "mistral_window", "gemma2", "phi3", "olmo2")
MODES = ("tp_accum", "dp_tp_fsdp", "pp_1f1b", "pp_interleaved", "pp_tp", "pp_fsdp")
PP_COMPOSED = ("qwen3",)  # the architectures also run as pp 2 x tp 2 and pp 2 x dp 2 (FSDP2)
TP_LAYERS = 2  # the TP modes' layer count (each TP layer costs collectives); pipelines cut 4 layers


# Whole outputs and inputs: colwise_rep / colwise_gather_output gather the output features, rowwise_rep /
# rowwise_split_input take a replicated input; `replicate` leaves a module whole.
REP_PLAN = {"layers.*.self_attn.q_proj": "colwise_rep", "layers.*.self_attn.k_proj": "colwise_gather_output",
            "layers.*.self_attn.v_proj": "colwise_rep", "layers.*.self_attn.o_proj": "rowwise_rep",
            "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise", "layers.*.input_layernorm": "replicate"}


def config(arch: str, layers: int = 4):
    """A tiny config: hidden 64, `layers` layers, 4 heads, 2 kv heads, untied, eager attention."""
    import transformers as t

    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        cfg = t.LlamaConfig(**common)
    elif arch == "qwen3":
        cfg = t.Qwen3Config(**common, head_dim=16)
    elif arch == "mistral":  # Mistral's own plan is Llama's: this one runs the other styles Loom applies
        cfg = t.MistralConfig(**common, sliding_window=None)
        cfg.base_model_tp_plan = REP_PLAN
    elif arch == "mistral_window":
        cfg = t.MistralConfig(**common, sliding_window=5)
    elif arch == "gemma2":  # alternating sliding (window 4 < seq 16) / full layers, both soft-cappings on
        cfg = t.Gemma2Config(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                             attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    elif arch == "phi3":
        cfg = t.Phi3Config(**common)
    elif arch == "olmo2":
        cfg = t.Olmo2Config(**common)
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    return cfg


def build(arch: str, layers: int = 4, device: str = "cpu"):
    """The architecture's *ForCausalLM in float64, the same weights for a given arch in every process."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(ARCHS.index(arch))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(arch, layers), dtype=torch.float64)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def reference(arch: str, layers: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process float64 training: per-step losses and final weights."""
    model = build(arch, layers)
    opt = optimizer(model.parameters())
    losses = []
    for x, y in batches():
        loss = loss_fn(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full(state: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _meta_tp_model(arch: str, tp_mesh, layers: int):
    """Built on the meta device, TP applied, then materialized (`to_empty`) and filled from the reference
    weights with `distribute_tensor` - the order Loom uses. Buffers (rotary inv_freq, Gemma's embed_scale)
    are not in the checkpoint and are refilled too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model = build(arch, layers=layers, device="meta")
    assert hf_parallel.apply_tensor_parallel(model, tp_mesh) > 0
    model.to_empty(device="cpu")
    real = build(arch, layers=layers)
    full = dict(real.named_parameters()) | dict(real.named_buffers())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if isinstance(t, DTensor):
                shard = distribute_tensor(full[name], t.device_mesh, t.placements, src_data_rank=None)
                assert shard.to_local().shape == t.to_local().shape, name
                t.to_local().copy_(shard.to_local())
            else:
                t.copy_(full[name])
    return model


def run_tp(arch: str, mesh, fsdp: bool) -> tuple[list[float], dict]:
    """TP over mesh['tp']: with FSDP2 over mesh['dp'] (data split over dp) or without (each dp replica runs
    the whole batch in 2 micro-batches of gradient accumulation)."""
    from torch.distributed.fsdp import fully_shard

    if fsdp:
        model = build(arch, layers=TP_LAYERS)
        hf_parallel.apply_tensor_parallel(model, mesh["tp"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        model = _meta_tp_model(arch, mesh["tp"], TP_LAYERS)
    opt = optimizer(model.parameters())
    dp, n_dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for x, y in batches():
        if fsdp:
            part = slice(dp * BATCH // n_dp, (dp + 1) * BATCH // n_dp)
            loss = loss_fn(model(input_ids=x[part], use_cache=False).logits, y[part])
            loss.backward()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total, group=mesh["dp"].get_group())
            losses.append(total.item() / n_dp)
        else:
            step = 0.0
            for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
                loss = loss_fn(model(input_ids=x[half], use_cache=False).logits, y[half]) / 2
                loss.backward()
                step += loss.item()
            losses.append(step)
        opt.step()
        opt.zero_grad()
    return losses, _full(model.state_dict())


def run_pp(arch: str, pp_mesh, interleaved: bool = False, tp_mesh=None, dp_mesh=None) -> tuple[list[float], dict]:
    """2 stages with Schedule1F1B, or 4 stages on 2 ranks (rank r holds r and r + 2) interleaved; each stage
    tensor-parallel over `tp_mesh` (TP applied to the pruned model), or sharded by FSDP2 over `dp_mesh` (the
    chunk a root, its layers units; the batch split over dp)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, size = pp_mesh.get_local_rank(), pp_mesh.size()
    n_stages = 2 * size if interleaved else size
    stages = [rank, rank + size] if interleaved else [rank]
    model = build(arch)
    chunks = hf_parallel.pipeline_chunks(model, stages, n_stages)
    if tp_mesh is not None:
        assert hf_parallel.apply_tensor_parallel(model, tp_mesh) > 0
    n_dp, dp = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    if dp_mesh is not None:
        for chunk in chunks:
            for layer in chunk.layers.values():
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(chunk, mesh=dp_mesh)
    group = pp_mesh.get_group()
    pipe = [PipelineStage(c, s, n_stages, torch.device("cpu"), group=group)
            for c, s in zip(chunks, stages, strict=True)]
    n_mb = 4 // n_dp
    if interleaved:
        schedule = ScheduleInterleaved1F1B(pipe, n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(pipe[0], n_microbatches=n_mb, loss_fn=loss_fn)
    opt = optimizer(model.parameters())
    holds_last = n_stages - 1 in stages
    losses = []
    for x, y in batches():
        part = slice(dp * BATCH // n_dp, (dp + 1) * BATCH // n_dp)
        mb_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x[part], target=y[part], losses=mb_losses)
        else:
            schedule.step(target=y[part], losses=mb_losses)
        total = torch.tensor(sum(m.item() for m in mb_losses) / n_mb if holds_last else 0.0, dtype=torch.float64)
        torch.distributed.all_reduce(total, group=group)
        if dp_mesh is not None:
            torch.distributed.all_reduce(total, group=dp_mesh.get_group())
        losses.append(total.item() / n_dp)
        opt.step()
        opt.zero_grad()
    return losses, _full(model.state_dict())


def worker(rank: int, world: int, init_file: str, out_dir: str, archs: tuple[str, ...]) -> None:
    """One of 4 gloo ranks, every architecture; results (losses, full weights) to out_dir/<rank>.pt.

    Per architecture: ranks {0,1} run TP with accumulation then 1F1B, while ranks {2,3} run the
    interleaved schedule; then all 4 run dp 2 x tp 2 with FSDP2, and for PP_COMPOSED pp 2 x tp 2 and
    pp 2 x dp 2 (FSDP2)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pair = mesh["tp"]  # ranks {0,1} or {2,3}
    results: dict = {}
    try:
        for arch in archs:
            if rank < 2:
                results[(arch, "tp_accum")] = run_tp(arch, mesh, fsdp=False)
                results[(arch, "pp_1f1b")] = run_pp(arch, pair, interleaved=False)
            else:
                results[(arch, "pp_interleaved")] = run_pp(arch, pair, interleaved=True)
            results[(arch, "dp_tp_fsdp")] = run_tp(arch, mesh, fsdp=True)
            if arch in PP_COMPOSED:  # stage 0 on ranks {0,1}, stage 1 on {2,3}
                results[(arch, "pp_tp")] = run_pp(arch, mesh["dp"], tp_mesh=mesh["tp"])
                results[(arch, "pp_fsdp")] = run_pp(arch, mesh["dp"], dp_mesh=mesh["tp"])
    except BaseException:  # report instead of leaving the other ranks to time out silently
        import traceback

        results["traceback"] = traceback.format_exc()
        torch.save(results, Path(out_dir) / f"{rank}.pt")
        os._exit(1)
    torch.save(results, Path(out_dir) / f"{rank}.pt")
    dist.destroy_process_group()
