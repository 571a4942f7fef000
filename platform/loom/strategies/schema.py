"""The schemas of the strategy options (conf/strategy/)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SingleStrategyConfig:
    name: str = "single"


@dataclass
class DDPStrategyConfig:
    name: str = "ddp"
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    comm_hook: str | None = None
    powersgd_rank: int = 1


@dataclass
class FSDPStrategyConfig:
    """FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy."""

    name: str = "fsdp"
    reshard_after_forward: bool = True
    hybrid_shard: bool = True
    shard_units: list[str] | None = None
    ep: int = 1   # expert parallelism (a mixture of experts): experts split over ep ranks of the dp dim
    cp: int = 1   # context parallelism: each sequence split over cp ranks (loom.models.context_parallel)
    cp_style: str = "ulysses"   # ulysses (all-to-all, any device) | ring (CUDA only)


@dataclass
class FSDPTPStrategyConfig:
    """FSDP2 across the data-parallel mesh dim x tensor parallel across the other."""

    name: str = "fsdp_tp"
    tensor_parallel: int = 2
    reshard_after_forward: bool = True
    shard_units: list[str] | None = None
    cp: int = 1
    cp_style: str = "ulysses"


@dataclass
class PPStrategyConfig:
    """Pipeline parallelism only: the GPT's blocks split into `pp` stages (-1: one per rank)."""

    name: str = "pp"
    pp: int = -1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None   # null: as many as pipeline ranks


@dataclass
class NDStrategyConfig:
    """replicate x shard x tensor x pipeline degrees (one of them may be -1: the rest of the world)."""

    name: str = "nd"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    reshard_after_forward: bool = True
    shard_units: list[str] | None = None
    ep: int = 1   # expert parallelism: experts split over ep ranks of dp_shard (tp = pp = 1 for now)
    cp: int = 1   # context parallelism: each sequence split over cp ranks (inside dp, outside tp)
    cp_style: str = "ulysses"


@dataclass
class DeepSpeedStrategyConfig:
    """DeepSpeed ZeRO stage 1/2/3 (`zero3_offload`: stage 3 + optimizer on the host)."""

    name: str = "zero2"
    offload_optimizer: bool = False
    offload_params: bool = False
    deepspeed_config: str | None = None


COMM_HOOKS = (None, "fp16_compress", "bf16_compress", "powersgd")

# DeepSpeed ZeRO stage of each zero* option.
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3}
