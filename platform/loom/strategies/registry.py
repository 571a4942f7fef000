"""One registry of the strategy options: what each one is, for every stage that asks.

Adding a strategy = a yaml in conf/strategy/, a schema in `schema.py`, a check in `checks.py`
when it has fields to check, a module with `build(cfg, layout)`, and one entry here. Every fact
another stage needs about an option (its place in `loom plan --compare`'s ties and suggestions,
async checkpoints, ...) is a field here with a default, so no list elsewhere names the options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.schema import no_check, nothing_to_fill
from loom.strategies import checks, variants
from loom.strategies.degrees import DEGREE_KEYS
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
    # Its place where layouts tie in `loom plan --compare` / strategy=auto (fewer moving parts first),
    # also the order `loom plan` tries `suggested` options in. A new option: after the presets, before nd.
    rank: int = 90
    # `loom plan` offers it when the run's own strategy does not fit (the cheapest that fits, by `rank`).
    suggested: bool = False
    # checkpoint.async: its checkpoints can be written in the background (DCP's async save).
    async_checkpoint: bool = False
    # The degrees its name leaves open, which a layout's label shows ("fsdp_tp tp=2"; plan/auto.py).
    open_degrees: tuple[str, ...] = ()
    # strategy=<name> alone means one device (hardware.devices=1 unless the user sets it; loom.compose).
    one_device: bool = False


_ZERO = dict(build="loom.strategies.deepspeed:build", check=checks.check_zero, normalize=checks.normalize_zero,
             mixed_precision="deepspeed", grad_buffers=True, suggested=True)
# fsdp, fsdp_tp, pp and nd: presets of one N-D mesh implementation (`pipeline.build_mesh`).
_MESH = "loom.strategies.pipeline:build_mesh"
_MODEL_PARALLEL = dict(build=_MESH, check=checks.check_model_parallel, mixed_precision="fsdp2", async_checkpoint=True)

STRATEGIES: dict[str, StrategyOption] = {
    "single": StrategyOption(SingleStrategyConfig, "replicate", "none", "loom.strategies.single:build",
                             check=checks.check_single, candidates=variants.alone, rank=0, one_device=True),
    "ddp": StrategyOption(DDPStrategyConfig, "replicate", "none", "loom.strategies.ddp:build",
                          check=checks.check_ddp, grad_buffers=True, rank=10, suggested=True),
    "fsdp": StrategyOption(FSDPStrategyConfig, "hybrid", "all", **_MODEL_PARALLEL, candidates=variants.sharded,
                           rank=40, suggested=True),
    "fsdp_tp": StrategyOption(FSDPTPStrategyConfig, "shard", "all", **_MODEL_PARALLEL,
                              candidates=variants.tensor_parallel, model_parallel=variants.tp_degree, rank=50,
                              open_degrees=("tp",)),
    "pp": StrategyOption(PPStrategyConfig, "replicate", "none", _MESH,
                         check=checks.check_pp, degrees=True, candidates=variants.pipelined,
                         model_parallel=variants.pp_degree, rank=70, open_degrees=("pp",)),
    "nd": StrategyOption(NDStrategyConfig, "shard", "all", _MESH,
                         check=checks.check_nd, mixed_precision="fsdp2", degrees=True,
                         candidates=variants.every_split, model_parallel=variants.tp_times_pp, rank=100,
                         open_degrees=DEGREE_KEYS),
    "zero1": StrategyOption(DeepSpeedStrategyConfig, "shard", "optimizer", **_ZERO, rank=20),
    "zero2": StrategyOption(DeepSpeedStrategyConfig, "shard", "optimizer+grads", **_ZERO, rank=30),
    "zero3": StrategyOption(DeepSpeedStrategyConfig, "shard", "all", **_ZERO, rank=60),
    "zero3_offload": StrategyOption(DeepSpeedStrategyConfig, "shard", "all", **{**_ZERO,
                                                                                 "check": checks.check_zero3_offload,
                                                                                 "candidates": variants.offloaded},
                                    rank=80),
}
# strategy=auto: no option of its own; plan/auto.py puts the layout `loom plan --compare` ranks first in its place.
AUTO = "auto"


def ranked() -> list[str]:
    """The options in `rank` order (ties in `loom plan --compare`, `loom plan`'s suggestions)."""
    return sorted(STRATEGIES, key=lambda name: STRATEGIES[name].rank)


def cheapest_first() -> list[str]:
    """The options `loom plan` suggests when a run does not fit, least communication first."""
    return [name for name in ranked() if STRATEGIES[name].suggested]


def async_checkpoint_options() -> list[str]:
    """The options whose checkpoints can be written in the background (checkpoint.async)."""
    return [name for name in ranked() if STRATEGIES[name].async_checkpoint]
