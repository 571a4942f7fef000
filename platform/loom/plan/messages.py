"""How many communication calls a device makes per optimizer step (no torch import).

`memory.comm_bytes` says how many bytes move; this says how many times. On small models and
on CPU (gloo over loopback) a call's fixed latency, not its bytes, is what separates layouts:
FSDP2 gathers every sharding unit twice and reduces it once per micro batch, tensor
parallelism all-reduces four times per block per micro batch, a pipeline sends one
activation and one gradient per microbatch and stage boundary, while DDP reduces a few
25 MB buckets once per step. `loom plan --compare` charges each call a latency
(`plan.compare.LATENCY_S`).
"""

from __future__ import annotations

from math import ceil

from omegaconf import DictConfig

from loom import strategies
from loom.layout import ParallelLayout
from loom.models import layer_count
from loom.plan.context import context_calls, state_shards
from loom.strategies.degrees import PP_SCHEDULES

DDP_BUCKET_BYTES = 25e6   # torch DDP's default bucket_cap_mb; ZeRO's reduce buckets are of this order too


def comm_messages(cfg: DictConfig, name: str, params: float, layout: ParallelLayout) -> dict[str, float]:
    """Calls per step per device: {data_parallel, tensor_parallel, pipeline, expert_parallel,
    context_parallel} (0 where none). FSDP2's gathers and reductions run over dp_shard x cp ranks."""
    out = {"data_parallel": 0.0, "tensor_parallel": 0.0, "pipeline": 0.0, "expert_parallel": 0.0,
           "context_parallel": 0.0}
    if layout.world == 1:
        return out
    accum = int(cfg.trainer.accumulate_grad_batches)
    blocks = (layer_count(cfg) or 1) / layout.pp        # this device's blocks
    micro = int(layout.pp_microbatches or 1) if layout.pp > 1 else 1  # forward/backward passes per micro batch
    if layout.dp * layout.cp > 1:
        out["data_parallel"] = _data_parallel_calls(cfg, name, params / (layout.tp * layout.pp), blocks,
                                                    accum, micro, state_shards(layout) > 1)
        if layout.dp_replicate > 1 and strategies.option(name).states == "all":
            out["data_parallel"] += blocks + 1  # HSDP: the shards' all-reduce across replicas, per unit
    if layout.tp > 1:
        out["tensor_parallel"] = 4 * blocks * accum * micro  # 2 forward + 2 backward all-reduces per block
    if layout.ep > 1:  # forward: the counts, the tokens there and back; backward: their gradients both ways
        out["expert_parallel"] = 5 * blocks * accum * micro
    if layout.cp > 1:  # all-to-alls (or ring sends) around every attention (plan.context)
        out["context_parallel"] = context_calls(cfg, layout)
    if layout.pp > 1:
        v = PP_SCHEDULES[str(layout.pp_schedule)].stages_per_rank
        out["pipeline"] = 2 * v * micro * accum  # one activation forward, one gradient backward per stage
    return out


def _data_parallel_calls(cfg: DictConfig, name: str, local_params: float, blocks: float, accum: int,
                         micro: int, sharded: bool) -> float:
    """Reductions (and gathers) over the data-parallel ranks per step; under pipelining a
    sharded unit is gathered for every microbatch and reduced after the last one."""
    grad_bytes = 4.0 * local_params
    buckets = max(1, ceil(grad_bytes / DDP_BUCKET_BYTES))
    states = strategies.option(name).states
    if states == "none":
        return buckets                      # one all-reduce per bucket (the accumulation steps skip the sync)
    if states == "optimizer":
        return 2 * buckets                  # reduce-scatter, then all-gather the updated parameters
    if states == "optimizer+grads":
        return (accum + 1) * buckets        # reduce-scatter every micro batch, all-gather once
    if not sharded:
        return 0.0                          # FSDP2 over replicas only: nothing to gather (HSDP's all-reduce above)
    s = cfg.strategy
    gathers = 1 if name == s.name and s.get("reshard_after_forward") is False else 2
    return accum * (blocks + 1) * (gathers * micro + 1)  # per unit (blocks + root): gathers + reduce-scatter
