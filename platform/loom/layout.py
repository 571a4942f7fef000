"""The parallel layout of a run: the one place that turns a world size into degrees.

World, nodes, data-parallel (replicate x shard), tensor-parallel and pipeline-parallel sizes
are computed here and nowhere else (as torchtitan's `ParallelDims`). Which split a strategy
uses is the strategy's to say (`loom.strategies.layout_of` reads it from the strategy
registry and asks `ParallelLayout.build`); every stage then asks the layout.

Ranks are laid out as a row-major (dp, pp, cp, tp) grid, as Lightning's ModelParallelStrategy
builds its (data_parallel, tensor_parallel) mesh: TP peers are consecutive ranks and share a
data-parallel rank, so they read the same batch; so do context-parallel peers (`cp`: each holds
a slice of every sequence of that batch, torchtitan's `cp` dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DP_MODES = ("replicate", "shard", "hybrid")


def world_of(hw: Any, nodes: int | None = None) -> int:
    """The ranks of a hardware profile: `hardware.devices` per node x `hardware.num_nodes` (or x
    `nodes`, a smaller world an elastic run may form). The one place devices are multiplied by
    nodes; a world torchrun actually formed comes from its environment instead."""
    return int(hw.devices) * int(hw.num_nodes if nodes is None else nodes)


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    devices_per_node: int
    dp_replicate: int = 1     # replicas of each shard (DDP; HSDP: across nodes)
    dp_shard: int = 1         # ranks over which sharded states (FSDP, ZeRO) are partitioned
    tp: int = 1
    pp: int = 1
    pp_schedule: str | None = None    # strategy.pp_schedule when pp > 1
    pp_microbatches: int | None = None  # microbatches per step when pp > 1
    # expert parallelism: a mixture of experts' routed experts split over `ep` consecutive ranks of
    # the data-parallel shard dim (each holds E / ep whole experts; FSDP2 shards them over the rest)
    ep: int = 1
    # context parallelism: each sequence of a micro batch split over `cp` consecutive ranks (inside
    # a data-parallel rank, outside tp), which exchange it around attention; FSDP2 shards over dp_shard x cp
    cp: int = 1
    cp_style: str | None = None   # strategy.cp_style when cp > 1: ulysses | ring

    @classmethod
    def build(cls, world: int, devices_per_node: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
              cp_style: str | None = None, dp_mode: str = "replicate") -> ParallelLayout:
        """dp = world / (tp x pp x cp), split by `dp_mode`: `replicate` (every dp rank holds
        everything), `shard` (states partitioned over dp), `hybrid` (HSDP: replicate across
        nodes, shard within one, when there are several nodes and no tensor parallelism)."""
        if dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode {dp_mode!r} not in {DP_MODES}")
        tp, pp, cp = max(1, int(tp)), max(1, int(pp)), max(1, int(cp))
        dp = max(1, int(world) // (tp * pp * cp))
        nodes = max(1, int(world) // max(1, int(devices_per_node)))
        if dp_mode == "replicate":
            replicate, shard = dp, 1
        elif dp_mode == "hybrid" and nodes > 1 and tp == 1 and pp == 1 and cp == 1 and dp % nodes == 0:
            replicate, shard = nodes, dp // nodes
        else:
            replicate, shard = 1, dp
        return cls(int(world), int(devices_per_node), replicate, shard, tp, pp, cp=cp,
                   cp_style=cp_style if cp > 1 else None)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world // max(1, self.devices_per_node))

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different batches one optimizer step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def hybrid(self) -> bool:
        """Sharded within a group and replicated across groups (HSDP)."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    def dp_rank(self, global_rank: int) -> int:
        """This rank's index along the data-parallel dimension (what its sampler shards by)."""
        return global_rank // self.batch_sharers

    @property
    def batch_sharers(self) -> int:
        """Ranks that read the same batch: one data-parallel rank's tp x pp x cp peers."""
        return self.tp * self.pp * self.cp

    def cp_rank(self, global_rank: int) -> int:
        """This rank's slice of each sequence (0 .. cp-1; the grid's cp dim sits outside tp)."""
        return global_rank // self.tp % self.cp

    def global_batch(self, micro_batch: int, accumulate: int) -> int:
        return micro_batch * accumulate * self.dp

    def accumulation_for(self, global_batch: int, micro_batch: int) -> int | None:
        """The gradient accumulation that makes `global_batch` at this layout's dp (None: no
        whole number of micro batches per dp rank does)."""
        per_step = micro_batch * self.dp
        if global_batch < per_step or global_batch % per_step:
            return None
        return global_batch // per_step

    def parallel(self) -> dict:
        """summary.json's `parallel`: the degrees of every dimension and the pipeline's
        schedule and microbatches (null without a pipeline)."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp,
                "ep": self.ep, "cp": self.cp, "cp_style": self.cp_style, "pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches}
