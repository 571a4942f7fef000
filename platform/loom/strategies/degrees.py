"""The parallel degrees of `strategy=pp | nd` (torch-free): fill in the one -1, check the
product against the world, and check the pipeline options against the model and the data.

`pp` is a preset of the same degrees (dp_replicate = dp_shard = tp = 1, pp = the world or the
user's). The pipeline schedules are a static table so validation never imports torch;
tests/test_pipeline_config.py checks it against the installed torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from omegaconf import DictConfig

from loom.errors import require
from loom.models import layer_count, model_key, split_problem

DEGREE_KEYS = ("dp_replicate", "dp_shard", "tp", "pp")


@dataclass(frozen=True)
class PipelineSchedule:
    torch_class: str       # its class in torch.distributed.pipelining.schedules
    stages_per_rank: int   # 1: one stage per pipeline rank; 2: two virtual stages (looped / V-shaped)
    rounds: bool = False   # microbatches run in rounds of pp: a multiple of max(1, m // pp) (torch's flex interleaving)


# strategy.pp_schedule -> the schedule (torch 2.13 has every one of them).
PP_SCHEDULES: dict[str, PipelineSchedule] = {
    "gpipe": PipelineSchedule("ScheduleGPipe", 1),
    "1f1b": PipelineSchedule("Schedule1F1B", 1),
    "interleaved_1f1b": PipelineSchedule("ScheduleInterleaved1F1B", 2, rounds=True),
    "interleaved_zero_bubble": PipelineSchedule("ScheduleInterleavedZeroBubble", 2, rounds=True),
    "zbv_zero_bubble": PipelineSchedule("ScheduleZBVZeroBubble", 2),
}
# Precisions a pipelined run trains in (fp16 would need a gradient scaler around the schedule's
# own backward, which Lightning's manual optimization does not give).
PIPELINE_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def resolve_degrees(node: Any, world: int, world_keys: str) -> dict[str, int]:
    """{dp_replicate, dp_shard, tp, pp} of `strategy` node at `world` ranks, the one -1 filled in
    with the rest of the world (ConfigError naming the keys otherwise). `world_keys` says where
    the world size comes from, for the messages."""
    given = {k: node.get(k, 1) for k in DEGREE_KEYS}
    for k, v in given.items():
        require(isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1), f"strategy.{k}", v,
                "must be a positive integer, or -1 for the rest of the world")
    free = [k for k, v in given.items() if v == -1]
    require(len(free) <= 1, f"strategy.{free[-1] if free else ''}", -1,
            f"only one degree may be -1 (the rest of the world), but {', '.join('strategy.' + k for k in free)} are")
    cp = context_degree(node)
    fixed = prod(v for v in given.values() if v != -1) * cp
    shown = " x ".join(f"strategy.{k}={v}" for k, v in given.items()) + (f" x strategy.cp={cp}" if cp > 1 else "")
    if free:
        require(world % fixed == 0, f"strategy.{free[0]}", -1,
                f"the other degrees ({shown}) multiply to {fixed}, which does not divide the world size "
                f"{world} ({world_keys}); valid products: {_divisors(world)}; world sizes these degrees "
                f"fit: {', '.join(str(fixed * k) for k in range(1, 5))}, ...")
        given[free[0]] = world // fixed
    else:
        require(fixed == world, "strategy", f"{shown} = {fixed}",
                f"the degrees must multiply to the world size {world} ({world_keys}); change one of them, "
                f"or set one to -1 to fill in the rest of the world (the world size that fits them: {fixed})")
    return given


def context_degree(node: Any) -> int:
    """strategy.cp (1 where the option has none): a fixed degree, never the rest of the world."""
    cp = node.get("cp", 1)
    require(isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1, "strategy.cp", cp,
            "must be a positive integer (1: no context parallelism; each sequence is split over cp ranks)")
    return int(cp)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def stages_of(node: Any, pp: int) -> int:
    """The number of pipeline stages (pp ranks x virtual stages per rank)."""
    sched = PP_SCHEDULES.get(str(node.get("pp_schedule", "1f1b")))
    return pp * (sched.stages_per_rank if sched else 1)


def microbatches_of(node: Any, pp: int) -> int:
    """strategy.pp_microbatches, or (null) as many as pipeline ranks."""
    m = node.get("pp_microbatches")
    return int(m) if m is not None else pp


def check_pipeline(cfg: DictConfig, pp: int) -> None:
    """The pipeline options against the torch schedules, the model's blocks and the batch."""
    s, model = cfg.strategy, cfg.model
    sched = s.pp_schedule
    require(sched in PP_SCHEDULES, "strategy.pp_schedule", sched,
            f"valid choices: {', '.join(PP_SCHEDULES)}")
    m = s.pp_microbatches
    require(m is None or m >= 1, "strategy.pp_microbatches", m, "must be a positive integer, or null (= strategy.pp)")
    if pp == 1:
        return
    # strategy=pp is dp = tp = 1: pp=1 there leaves the world unfilled; under nd another degree takes it
    unpiped = "" if s.name == "pp" else "strategy.pp=1 strategy.dp_shard=-1, or "
    problem = split_problem(cfg, "pipeline")
    require(problem is None, "strategy.pp", pp,
            f"model={model.name} cannot be split into pipeline stages: {problem}; use {unpiped}strategy=fsdp / ddp "
            "for this model")
    stages = stages_of(s, pp)
    per_rank = PP_SCHEDULES[sched].stages_per_rank
    layers, key = layer_count(cfg), model_key(cfg, "layers")
    require(stages <= layers, "strategy.pp", pp,
            f"{stages} pipeline stages ({pp} ranks x {per_rank} per rank under pp_schedule={sched}) need at "
            f"least as many layers, but {key}={layers}: use {key}={stages} (or more)"
            + (f", or strategy.pp_schedule=1f1b (one stage per rank: {pp} layers)" if per_rank > 1 and pp <= layers
               else "") + ("" if s.pp == -1 else f", or strategy.pp <= {layers // per_rank}"))
    mb = microbatches_of(s, pp)
    require(mb >= pp, "strategy.pp_microbatches", mb,
            f"fewer microbatches than the {pp} pipeline ranks (strategy.pp={pp}) leaves stages idle every "
            f"step; valid: >= {pp}")
    bs = cfg.dataset.batch_size
    require(bs % mb == 0, "strategy.pp_microbatches", mb,
            f"must divide dataset.batch_size={bs} (the per-rank batch is split into equal microbatches); "
            f"valid: {_divisors(bs)}")
    if PP_SCHEDULES[sched].rounds:
        _check_rounds(sched, mb, pp, bs)
    acc = cfg.trainer.accumulate_grad_batches
    require(acc == 1, "trainer.accumulate_grad_batches", acc,
            f"strategy.pp={pp} accumulates over strategy.pp_microbatches instead (the schedule runs every "
            "microbatch's forward and backward in one step); set trainer.accumulate_grad_batches=1")
    prec = cfg.hardware.precision
    require(prec in PIPELINE_PRECISIONS, "hardware.precision", prec,
            f"strategy.pp={pp} has no gradient scaler for 16-mixed; valid choices: {', '.join(PIPELINE_PRECISIONS)}")


def _check_rounds(sched: str, mb: int, pp: int, bs: int) -> None:
    """The interleaved schedules run the microbatches in max(1, m // pp) equal rounds (torch
    raises at the first step otherwise, after every rank has started)."""
    rounds = max(1, mb // pp)
    valid = [m for m in range(pp, bs + 1) if bs % m == 0 and m % max(1, m // pp) == 0]
    require(mb % rounds == 0, "strategy.pp_microbatches", mb,
            f"pp_schedule={sched} runs the microbatches in max(1, m // strategy.pp) = {rounds} equal rounds, "
            f"so they must be a multiple of {rounds}; valid with dataset.batch_size={bs}: "
            f"{', '.join(map(str, valid))}")
