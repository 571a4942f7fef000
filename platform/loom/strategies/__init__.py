"""Strategies (conf/strategy/): how the model, its gradients and optimizer states are spread
over ranks. The package top is torch-free (schemas, checks, the layout, the DeepSpeed JSON);
`build_strategy` imports the one strategy module a run uses:

single / ddp: Lightning's SingleDeviceStrategy / DDPStrategy (`single.py`, `ddp.py`).
fsdp / fsdp_tp / pp / nd: presets of one N-D mesh (`pipeline.build_mesh`): Lightning's
    ModelParallelStrategy with FSDP2 and tensor parallelism (`model_parallel.py`), extended with
    pipeline stages over the pp ranks, each FSDP2 x TP sharded (`pipeline.py`), when pp > 1;
    pp and nd take their degrees from `degrees.py`.
zero1 | zero2 | zero3 | zero3_offload: DeepSpeed ZeRO (`deepspeed.py`).
Every strategy class also answers Loom's two questions about its states (`base.LoomStrategy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout, world_of
from loom.schema import load
from loom.strategies import checks
from loom.strategies.registry import AUTO as AUTO  # strategy=auto (loom.pipeline)
from loom.strategies.registry import STRATEGIES, StrategyOption, async_checkpoint_options


class _Schemas(Mapping[str, type]):
    """Each option's schema, read from the registry when asked (one owner: an option the registry
    gains, also at runtime, is typed by `loom.validate` with no second list to edit)."""

    def __getitem__(self, name: str) -> type:
        return STRATEGIES[name].schema

    def __iter__(self) -> Iterator[str]:
        return iter(STRATEGIES)

    def __len__(self) -> int:
        return len(STRATEGIES)


SCHEMAS: Mapping[str, type] = _Schemas()


def option(name: str) -> StrategyOption:
    return STRATEGIES[name]


def layout_of(cfg: DictConfig, world: int | None = None, name: str | None = None) -> ParallelLayout:
    """The parallel layout of the run's strategy (or of strategy `name` on the same hardware, as
    `loom plan` weighs alternatives) at `world` ranks (default: the profile's devices x nodes)."""
    hw, s = cfg.hardware, cfg.strategy
    name = name or s.name
    node: Any = s if name == s.name else {}
    world = world_of(hw) if world is None else world
    if STRATEGIES[name].degrees:  # pp, nd: the option's own degrees, the one -1 filled in
        from dataclasses import asdict

        from loom.strategies.degrees import context_degree, microbatches_of, resolve_degrees

        node = node or asdict(STRATEGIES[name].schema())
        d = resolve_degrees(node, world, f"hardware.devices={hw.devices} x hardware.num_nodes={hw.num_nodes}")
        pipe = (str(node.get("pp_schedule")), microbatches_of(node, d["pp"])) if d["pp"] > 1 else (None, None)
        cp = context_degree(node)
        return ParallelLayout(world, hw.devices, d["dp_replicate"], d["dp_shard"], d["tp"], d["pp"], *pipe,
                              ep=int(node.get("ep", 1) or 1), cp=cp,
                              cp_style=str(node.get("cp_style", "ulysses")) if cp > 1 else None)
    mode = STRATEGIES[name].dp_mode
    if mode == "hybrid" and not node.get("hybrid_shard", True):
        mode = "shard"
    from loom.strategies.degrees import context_degree

    cp = context_degree(node)
    layout = ParallelLayout.build(world, hw.devices, tp=int(node.get("tensor_parallel", 1) or 1), cp=cp,
                                  cp_style=str(node.get("cp_style", "ulysses")), dp_mode=mode)
    return dataclasses.replace(layout, ep=int(node.get("ep", 1) or 1))


def normalize(cfg: DictConfig) -> None:
    STRATEGIES[cfg.strategy.name].normalize(cfg)


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    STRATEGIES[cfg.strategy.name].check(cfg, layout)


def check_checkpoint(cfg: DictConfig) -> None:
    """checkpoint.*: export settings Loom writes, and checkpoint.async where the strategy can run it."""
    checks.check_checkpoint(cfg, async_checkpoint_options())


def lightning_precision(cfg: DictConfig) -> str:
    """The `precision` the Trainer gets: one mixed-precision mechanism per strategy.

    Lightning gives ModelParallelStrategy its autocast plugin for "bf16-mixed", while FSDP2's
    MixedPrecisionPolicy (`model_parallel.parallelize`) already runs the forward and backward in
    bf16 with fp32 sharded parameters and fp32 gradient reduction: autocast on top would only
    add casts. So fsdp/fsdp_tp train "bf16-mixed" as "32-true" as far as Lightning is concerned.
    """
    precision = str(cfg.hardware.precision)
    option = STRATEGIES[cfg.strategy.name]
    # Under pipelining (pp, nd with pp > 1) autocast stays Lightning's: no FSDP2 policy there.
    fsdp2 = option.mixed_precision == "fsdp2" and not (option.degrees and layout_of(cfg).pp > 1)
    if fsdp2 and precision == "bf16-mixed":
        return "32-true"
    return precision


def build_strategy(cfg: DictConfig, layout: ParallelLayout) -> Any:
    """The Lightning strategy object of this run (imports torch, Lightning and the strategy's library)."""
    return load(STRATEGIES[cfg.strategy.name].build)(cfg, layout)
