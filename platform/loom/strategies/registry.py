"""One registry of the strategy options: what each one is, for every stage that asks.

Adding a strategy = a yaml in conf/strategy/, a schema in `schema.py`, a check in `checks.py`
when it has fields to check, a module with `build(cfg, layout)`, and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.schema import no_check, nothing_to_fill
from loom.strategies import checks, variants
from loom.strategies.schema import (
    DDPStrategyConfig,
    DeepSpeedStrategyConfig,
    FSDPStrategyConfig,
    FSDPTPStrategyConfig,
    NDStrategyConfig,
    PPStrategyConfig,
    SingleStrategyConfig,
)


@dataclass(frozen=True)
class StrategyOption:
    schema: type
    dp_mode: str      # how the data-parallel ranks split (loom.layout): replicate | shard | hybrid
    states: str       # which training states are partitioned (loom.plan): none | optimizer | optimizer+grads | all
    build: str        # "module:function" that builds the Lightning strategy (imports torch)
    check: Callable[[DictConfig, ParallelLayout], None] = no_check
    normalize: Callable[[DictConfig], None] = nothing_to_fill
    # Who implements `*-mixed` precision, exactly one mechanism per strategy (`lightning_precision`):
    # autocast (Lightning's MixedPrecision plugin) | fsdp2 (MixedPrecisionPolicy, no autocast)
    # | deepspeed (the engine's bf16/fp16 modes, through Lightning's DeepSpeedPrecision).
    mixed_precision: str = "autocast"
    # The layout comes from the option's own degrees (strategy.dp_replicate/dp_shard/tp/pp,
    # `loom.strategies.degrees`) rather than from dp_mode and tensor_parallel.
    degrees: bool = False
    # The candidates it offers `loom plan --compare` / strategy=auto on a machine (strategy fields over
    # its yaml; `strategies/variants.py`), and the ranks one data-parallel replica of a candidate spans (tp x pp).
    candidates: Callable[[variants.Machine], list[variants.Fields]] = variants.data_parallel
    model_parallel: Callable[[DictConfig, int], int] = variants.no_model_parallel
    # Gradients in buffers the strategy keeps from step to step (DDP's buckets, DeepSpeed's
    # partitions), i.e. beside the activations even with the `.grad` tensors freed (`loom.plan.memory`).
    grad_buffers: bool = False


_ZERO = dict(build="loom.strategies.deepspeed:build", check=checks.check_zero, normalize=checks.normalize_zero,
             mixed_precision="deepspeed", grad_buffers=True)
# fsdp, fsdp_tp, pp and nd: presets of one N-D mesh implementation (`pipeline.build_mesh`).
_MESH = "loom.strategies.pipeline:build_mesh"
_MODEL_PARALLEL = dict(build=_MESH, check=checks.check_model_parallel, mixed_precision="fsdp2")

STRATEGIES: dict[str, StrategyOption] = {
    "single": StrategyOption(SingleStrategyConfig, "replicate", "none", "loom.strategies.single:build",
                             check=checks.check_single, candidates=variants.alone),
    "ddp": StrategyOption(DDPStrategyConfig, "replicate", "none", "loom.strategies.ddp:build",
                          check=checks.check_ddp, grad_buffers=True),
    "fsdp": StrategyOption(FSDPStrategyConfig, "hybrid", "all", **_MODEL_PARALLEL, candidates=variants.sharded),
    "fsdp_tp": StrategyOption(FSDPTPStrategyConfig, "shard", "all", **_MODEL_PARALLEL,
                              candidates=variants.tensor_parallel, model_parallel=variants.tp_degree),
    "pp": StrategyOption(PPStrategyConfig, "replicate", "none", _MESH,
                         check=checks.check_pp, degrees=True, candidates=variants.pipelined,
                         model_parallel=variants.pp_degree),
    "nd": StrategyOption(NDStrategyConfig, "shard", "all", _MESH,
                         check=checks.check_nd, mixed_precision="fsdp2", degrees=True,
                         candidates=variants.every_split, model_parallel=variants.tp_times_pp),
    "zero1": StrategyOption(DeepSpeedStrategyConfig, "shard", "optimizer", **_ZERO),
    "zero2": StrategyOption(DeepSpeedStrategyConfig, "shard", "optimizer+grads", **_ZERO),
    "zero3": StrategyOption(DeepSpeedStrategyConfig, "shard", "all", **_ZERO),
    "zero3_offload": StrategyOption(DeepSpeedStrategyConfig, "shard", "all", **{**_ZERO,
                                                                                 "check": checks.check_zero3_offload,
                                                                                 "candidates": variants.offloaded}),
}
