"""How much of a step's communication its compute hides, strategy by strategy (no torch import).

`loom plan --compare` (`plan.compare.predict`) prices each kind of collective in seconds
(`Wire`: bytes / bandwidth plus its calls' latency) and asks `exposed_s` what is left on the
critical path once the libraries' own scheduling has overlapped what it can:

- FSDP2 (fsdp, fsdp_tp, nd's dp_shard; one unit per block plus the root): forward prefetches
  the next unit's all-gather while the current unit computes; backward prefetches the next
  all-gather and reduce-scatters (HSDP: then all-reduces) each unit's gradients while the next
  unit computes. Per pass (micro batch, or pipeline microbatch): exposed = the first unit's
  all-gather + sum over the other units of max(0, comm_unit - compute_unit), and in backward
  the last unit's reduce-scatter (`_pipelined`: exact for equal units).
- DeepSpeed ZeRO-3: the same shape, per module and from the host's hooks, with each unit's
  compute hiding only ZERO3_OVERLAP of what FSDP2's does (assumed: not measured on a GPU; the
  CPU runs measured zero3 slower than fsdp at world 2 and 4, docs/benchmarks.md).
- DDP: gradient buckets all-reduce while the backward of the last micro batch (the one that
  syncs) goes on; the last bucket is exposed. ZeRO-1/2 with overlap_comm: the gradient
  reduction overlaps backward the same way (ZeRO-2 every micro batch, ZeRO-1 the last); the
  updated parameters' all-gather after the optimizer step is exposed.
- Tensor-parallel all-reduces block the layer that waits for them, pipeline sends are counted
  as before and zero3_offload's host transfers too: all exposed. So are context parallelism's
  exchanges around attention (`plan/context.py`: Ulysses' all-to-alls block; ring's overlap with
  each chunk's attention in torch, so theirs is an upper bound).

Backward is 2/3 of the compute (forward 1/3; recomputation adds its forward to backward).
A unit's compute hides communication only at OVERLAP of its length: 1 on GPUs (NCCL runs on
its own streams), 0 on CPU, where gloo's threads run on the same cores as the ranks' compute
(docs/benchmarks.md: every CPU layout that could hide communication measured at or above its
fully exposed prediction, so the calibrated CPU ranking stays as it was).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from omegaconf import DictConfig

from loom import strategies
from loom.models import layer_count
from loom.plan import Plan
from loom.plan.messages import DDP_BUCKET_BYTES
from loom.strategies.deepspeed_config import zero_stage

OVERLAP = {"gpu": 1.0, "cpu": 0.0}  # the share of a unit's compute that communication runs beside
ZERO3_OVERLAP = 0.5                 # DeepSpeed ZeRO-3's per-module fetches hide half what FSDP2's do (assumed)
FORWARD = 1 / 3                     # forward's share of a step's compute without recomputation
RECOMPUTE = {"none": 1.0, "selective": 1.0 + FORWARD / 2, "full": 1.0 + FORWARD}  # compute x, by activation checkpointing


@dataclass(frozen=True)
class Wire:
    """Seconds per step one device spends in each kind of communication."""

    gather: float = 0.0    # parameter all-gathers over the data-parallel ranks
    reduce: float = 0.0    # gradient reduce-scatters / all-reduces over the data-parallel ranks
    tensor: float = 0.0    # tensor-parallel activation all-reduces
    pipeline: float = 0.0  # pipeline sends
    host: float = 0.0      # zero3_offload's host <-> device transfers
    context: float = 0.0   # context parallelism's all-to-alls / ring sends around attention

    @property
    def total(self) -> float:
        return self.gather + self.reduce + self.tensor + self.pipeline + self.host + self.context


def exposed_s(cfg: DictConfig, plan: Plan, wire: Wire, compute: float | None) -> float:
    """The seconds of `wire` that no compute hides (<= wire.total; = it with no compute known)."""
    blocking = wire.tensor + wire.pipeline + wire.host + wire.context
    dp = wire.gather + wire.reduce
    eff = OVERLAP.get(str(plan.accelerator), 1.0)
    if compute is None or not dp or not eff:
        return blocking + dp
    base = compute / RECOMPUTE.get(plan.activation_checkpointing, 1.0)
    fwd, bwd = FORWARD * base, compute - FORWARD * base
    accum = int(plan.accumulate_grad_batches)
    micro = int(plan.parallel.get("pp_microbatches") or 1) if int(plan.parallel.get("pp", 1)) > 1 else 1
    states = strategies.option(plan.strategy).states
    stage = zero_stage(plan.strategy)
    if stage is not None and not _overlap_comm(plan):
        return blocking + dp  # DeepSpeed without overlap_comm: every reduction waits for backward
    if states == "all":
        if stage is not None:
            eff *= ZERO3_OVERLAP
        return blocking + _sharded(cfg, plan, wire, eff * fwd, eff * bwd, accum * micro)
    buckets = max(1, ceil(4.0 * (plan.params or 0) / (plan.tensor_parallel * int(plan.parallel.get("pp", 1)))
                          / DDP_BUCKET_BYTES))
    passes = accum if states == "optimizer+grads" else 1  # ZeRO-2 reduces every micro batch, DDP / ZeRO-1 the last
    per_pass = eff * bwd / (accum * micro)
    reduce = passes * _pipelined(buckets, wire.reduce / passes / buckets, per_pass / buckets)
    return blocking + reduce + wire.gather  # ZeRO-1/2's post-step all-gather: nothing left to hide it


def _sharded(cfg: DictConfig, plan: Plan, wire: Wire, fwd: float, bwd: float, passes: int) -> float:
    """FSDP2-style prefetch over the units of each pass: forward gathers, then backward's
    gathers (when resharded after forward) and reductions, each pipelined behind the units'
    compute (`fwd`, `bwd`: the step's hiding compute, already scaled by the overlap)."""
    units = (layer_count(cfg) or 1) / int(plan.parallel.get("pp", 1)) + 1  # blocks + the root
    n = max(1, round(units))
    gathers = 1 if plan.strategy_config.get("reshard_after_forward") is False else 2
    g_fwd = wire.gather / gathers
    g_bwd = wire.gather - g_fwd
    per = passes * n
    forward = _pipelined(n, g_fwd / per, fwd / per)
    backward = _pipelined(n, (g_bwd + wire.reduce) / per, bwd / per)
    return passes * (forward + backward)


def _pipelined(n: int, comm: float, compute: float) -> float:
    """Exposed seconds of n equal chunks, each's communication running beside the next chunk's
    compute: the first (or last) chunk's whole, and the rest's excess over their compute."""
    return comm + (n - 1) * max(0.0, comm - compute)


def _overlap_comm(plan: Plan) -> bool:
    """DeepSpeed's zero_optimization.overlap_comm as resolved (null: DeepSpeed's default, on at stage 3)."""
    zero = (plan.deepspeed_config or {}).get("zero_optimization") or {}
    value = zero.get("overlap_comm")
    return zero_stage(plan.strategy) == 3 if value is None else bool(value)
