"""The pipeline's share of `loom plan` (no torch import): bubble fraction, memory per pipeline
rank (its stages' states and the activations of its microbatches in flight) and the bytes
each rank sends to its neighbours.

Bubble: with p pipeline ranks, m microbatches and v stages per rank, a step is m*v stage
slots of useful work per rank plus p - 1 idle slots while the pipeline fills and drains
(GPipe and 1F1B, Huang et al. 2019; Narayanan et al. 2021, section 2.2: the interleaved
schedule divides the bubble by v), so the idle fraction of the step is (p-1)/(v*m + p-1).
Zero-bubble schedules fill part of that with weight-gradient work; the plan counts them as
the interleaved schedule (an upper bound).

Activations in flight on pipeline rank r (Narayanan et al. 2021, section 2.2.1): GPipe keeps
every microbatch's (m); 1F1B starts backward once the pipe is full, so rank r keeps at most
p - r (the first stage the most, p); interleaved 1F1B warms up (v-1)*p + 2*(p-r-1) stage
chunks before its first backward (Megatron's schedule), plus the one in flight.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models import layer_count, model_parts, model_width, vocab_size
from loom.plan.memory import MemoryEstimate, per_param_bytes, state_bytes
from loom.strategies.degrees import PP_SCHEDULES
from loom.strategies.pipeline import stage_blocks, stage_ids


@dataclass
class StagePlan:
    """One pipeline rank: its stages, blocks, parameters and memory per device."""

    pp_rank: int
    stages: list[int]
    blocks: list[int]
    embeddings: bool               # holds wte + wpe (the first stage)
    head: bool                     # holds ln_f + lm_head (the last stage)
    params: int
    microbatches_in_flight: int    # stage chunks whose activations wait for their backward
    memory_bytes: dict[str, float]


def bubble_fraction(pp: int, microbatches: int, per_rank: int = 1) -> float:
    """The idle share of a step: (p-1) / (v*m + p-1)."""
    return (pp - 1) / (per_rank * microbatches + pp - 1) if pp > 1 else 0.0


def in_flight(schedule: str, pp: int, microbatches: int, per_rank: int, pp_rank: int) -> int:
    """Stage chunks whose activations rank `pp_rank` holds at once (see the module docstring)."""
    if schedule == "gpipe":
        return microbatches
    if per_rank == 1:
        return min(microbatches, pp - pp_rank)
    return min(microbatches * per_rank, (per_rank - 1) * pp + 2 * (pp - pp_rank - 1) + 1)


def _states(cfg: DictConfig, name: str, layout: ParallelLayout, params: int, whole: int) -> MemoryEstimate:
    hw = cfg.hardware
    kw = dict(per_param=per_param_bytes(name, hw.precision, cfg.optim), offload_optimizer=False)
    mixed = hw.precision != "32-true"
    if layout.tp == 1:
        return state_bytes(name, params, layout.dp_shard, mixed, **kw)
    split = state_bytes(name, params - whole, layout.dp_shard * layout.tp, mixed, **kw)
    rep = state_bytes(name, whole, layout.dp_shard, mixed, **kw)
    return MemoryEstimate(split.params + rep.params, split.grads + rep.grads, split.optimizer + rep.optimizer, 0.0)


def _chunk_activations(cfg: DictConfig, layout: ParallelLayout, n_blocks: int, last: bool, micro: int,
                       layer_params: int = 0) -> float:
    """One microbatch's stored activations for `n_blocks` blocks (memory.activation_bytes's
    arithmetic, checkpointing included), plus the logits at the loss on the last stage.

    Under pipelining `*-mixed` precision is Lightning's autocast over fp32 weights
    (strategies.lightning_precision): each microbatch's forward saves, for its backward, the
    16-bit copy autocast makes of every weight it multiplies (2 bytes x the layers' TP-local
    `layer_params`; FSDP2 gathers the weights again for each microbatch, so nothing is shared),
    and what runs outside autocast's 16-bit ops (the residual stream, the norms' inputs: the 10
    s*b*h per layer tensor parallelism repeats) stays fp32. `loom plan --rehearse` measured both
    (a 70B shape, tp 8, pp 4: activations 4.06 GB planned before, 21.6 GB rehearsed)."""
    mixed = cfg.hardware.precision != "32-true"
    autocast = cfg.hardware.precision in ("bf16-mixed", "16-mixed")
    s, h = cfg.dataset.seq_len, model_width(cfg)
    parts = model_parts(cfg)
    full = parts.layer_activation_bytes(s * micro, layout.tp, mixed)
    if autocast:
        full += parts.act_autocast_extra * s * micro  # GPT: the repeated part in fp32, 4 bytes instead of 2
    mode = cfg.trainer.get("activation_checkpointing", "none")
    ckpt = {"none": 0, "selective": (n_blocks + 1) // 2, "full": n_blocks}[mode]
    stored = (n_blocks - ckpt) * full + ckpt * s * micro * h * (2.0 if mixed else 4.0) + (full if ckpt else 0.0)
    copies = 2.0 * n_blocks * layer_params / layout.tp if autocast else 0.0
    return stored + copies + (2 * 4 * micro * s * vocab_size(cfg) / layout.tp if last else 0.0)


def stage_plans(cfg: DictConfig, name: str, layout: ParallelLayout) -> list[StagePlan]:
    """Every pipeline rank's stages and memory per device (models that declare their Parts:
    Loom's GPT and Llama; [] without a pipeline)."""
    parts = model_parts(cfg)
    if layout.pp == 1 or parts is None:
        return []
    sched = str(layout.pp_schedule)
    v = PP_SCHEDULES[sched].stages_per_rank
    n_stages, mb = layout.pp * v, int(layout.pp_microbatches or layout.pp)
    micro = max(1, cfg.dataset.batch_size // mb)
    style = "v" if "zbv" in sched else "loop"
    out = []
    for r in range(layout.pp):
        stages = stage_ids(r, layout.pp, v, style)
        chunks = [(len(stage_blocks(st, n_stages, layer_count(cfg))), st == n_stages - 1) for st in stages]
        blocks = [b for st in stages for b in stage_blocks(st, n_stages, layer_count(cfg))]
        first, last = 0 in stages, n_stages - 1 in stages
        params = len(blocks) * parts.per_layer + (parts.first if first else 0) + (parts.last if last else 0)
        mem = _states(cfg, name, layout, params, parts.tp_whole(len(blocks), first, last))
        flight = in_flight(sched, layout.pp, mb, v, r)
        # the chunks in flight spread over this rank's stages; the largest chunk bounds them
        mem.activations = flight * max(_chunk_activations(cfg, layout, n, lst, micro, parts.per_layer)
                                       for n, lst in chunks)
        out.append(StagePlan(r, stages, blocks, first, last, params, flight,
                             {**asdict(mem), "states": mem.states, "total": mem.total}))
    return out


def pipeline_summary(cfg: DictConfig, name: str, layout: ParallelLayout) -> dict | None:
    """plan.json's `pipeline` (None without one): schedule, microbatches, bubble, stages."""
    stages = stage_plans(cfg, name, layout)
    if not stages:
        return None
    v = PP_SCHEDULES[str(layout.pp_schedule)].stages_per_rank
    mb = int(layout.pp_microbatches or layout.pp)
    return {"schedule": layout.pp_schedule, "microbatches": mb, "stages_per_rank": v,
            "bubble_fraction": bubble_fraction(layout.pp, mb, v),
            "stages": [asdict(s) for s in stages]}


def p2p_bytes(cfg: DictConfig, layout: ParallelLayout) -> float:
    """Bytes a middle pipeline rank sends per step: each stage chunk's output activations
    forward and its input gradients backward, for every microbatch (the per-rank batch)."""
    if layout.pp == 1 or not model_width(cfg):
        return 0.0
    v = PP_SCHEDULES[str(layout.pp_schedule)].stages_per_rank
    act = 4.0 if cfg.hardware.precision == "32-true" else 2.0
    return 2.0 * v * cfg.dataset.batch_size * cfg.dataset.seq_len * model_width(cfg) * act
