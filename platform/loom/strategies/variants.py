"""The layouts each strategy option offers `loom plan --compare` and `strategy=auto` on a world.

Each option's registry entry names one of these (`StrategyOption.variants`): given the world and
the machine, the strategy fields each candidate sets over the option's yaml (an empty list: the
option has no candidate there). The comparison itself (plan/compare.py) stays free of strategy
names. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod
from typing import Any

from loom.strategies.degrees import DEGREE_KEYS


@dataclass(frozen=True)
class Machine:
    world: int
    devices_per_node: int
    gpu: bool
    pipeline: dict[str, Any]  # the user's pp_schedule / pp_microbatches, carried to pipelined layouts
    experts: int = 0  # a mixture of experts' routed experts per layer (0: none): the ep degrees to try
    # context parallelism: the cp degrees to offer (empty: none; plan.context.cp_degrees and its rule),
    # the heads every cp x tp must divide for Ulysses (gcd of query and key/value heads; 0: unknown)
    # and seq_len (ring's two chunks per rank)
    context: tuple[int, ...] = ()
    heads: int = 0
    seq_len: int = 0


Fields = dict[str, Any]


def alone(m: Machine) -> list[Fields]:
    """`single`: one device, so only a world of one."""
    return [{}] if m.world == 1 else []


def data_parallel(m: Machine) -> list[Fields]:
    """ddp, fsdp, zero1-3: their yaml as it is, on a world of several ranks."""
    return [{}] if m.world > 1 else []


def expert_degrees(m: Machine, shard: int) -> list[int]:
    """strategy.ep values beyond 1 for a mixture of experts: dividing its experts and the shard dim."""
    return [e for e in range(2, shard + 1) if m.experts and m.experts % e == 0 and shard % e == 0]


def context_fields(m: Machine, tp: int) -> list[Fields]:
    """strategy.cp / cp_style of each cp degree the machine offers beside `tp` tensor-parallel ranks:
    ulysses where cp x tp divides the heads, else ring on CUDA (seq_len in 2 x cp chunks), else none."""
    out: list[Fields] = []
    for c in m.context:
        if m.world % (c * tp):
            continue
        if not m.heads or m.heads % (c * tp) == 0:
            out.append({"cp": c})  # strategy.cp_style's default
        elif m.gpu and m.seq_len % (2 * c) == 0:
            out.append({"cp": c, "cp_style": "ring"})
    return out


def sharded(m: Machine) -> list[Fields]:
    """fsdp: its yaml on a world of several ranks, for a mixture of experts each ep degree, and for
    long sequences each cp degree."""
    if m.world <= 1:
        return []
    return [{}, *({"ep": e} for e in expert_degrees(m, m.world)), *context_fields(m, 1)]


def offloaded(m: Machine) -> list[Fields]:
    """zero3_offload: on a GPU at any world (on CPU the host *is* the device: it moves nothing)."""
    return [{}] if m.gpu else []


def tensor_parallel(m: Machine) -> list[Fields]:
    """fsdp_tp: every tensor-parallel degree of one node that divides the world (each with the cp
    degrees beside it, for long sequences)."""
    out: list[Fields] = []
    for tp in (d for d in range(2, m.devices_per_node + 1) if m.world % d == 0):
        out += [{"tensor_parallel": tp}, *({"tensor_parallel": tp, **f} for f in context_fields(m, tp))]
    return out


def pipelined(m: Machine) -> list[Fields]:
    """pp: every rank a stage, with the user's schedule and microbatches."""
    return [dict(m.pipeline)] if m.world > 1 else []


def factorizations(world: int) -> list[tuple[int, int, int, int]]:
    """Every (dp_replicate, dp_shard, tp, pp) whose product is `world`."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [f for f in product(divs, repeat=4) if prod(f) == world]


def every_split(m: Machine) -> list[Fields]:
    """nd: every split of the world into the four degrees (pipelined ones with the user's schedule)."""
    if m.world <= 1:
        return []
    out = []
    for degrees in factorizations(m.world):
        d = dict(zip(DEGREE_KEYS, degrees, strict=True))
        out.append({**d, **(m.pipeline if d["pp"] > 1 else {})})
        if d["tp"] == d["pp"] == d["dp_replicate"] == 1:  # expert parallelism is built beside FSDP2 alone
            out += [{**d, "ep": e} for e in expert_degrees(m, d["dp_shard"])]
    for c in m.context:  # context parallelism: the rest of the world split the same ways, no pipeline
        for degrees in factorizations(m.world // c):
            d = dict(zip(DEGREE_KEYS, degrees, strict=True))
            out += [{**d, **f} for f in context_fields(m, d["tp"]) if f["cp"] == c and d["pp"] == 1]
    return out


def no_model_parallel(node: Any, world: int) -> int:
    return 1


def tp_degree(node: Any, world: int) -> int:
    return int(node.tensor_parallel)


def pp_degree(node: Any, world: int) -> int:
    return world if int(node.pp) == -1 else int(node.pp)


def tp_times_pp(node: Any, world: int) -> int:
    return int(node.tp) * int(node.pp)
