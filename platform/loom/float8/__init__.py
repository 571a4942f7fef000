"""float8 training (conf/float8/: `float8=none|tensorwise|rowwise|rowwise_with_gw_hp|mxfp8`): the model's
Linear layers compute in float8 through torchao, beside `hardware.precision` for the rest.

The package top is torch-free (the schema, the checks, what the plan and the worker ask: `emulated`,
`all_gather_active`, `peak_key`); the worker's conversion (torchao's `convert_to_float8_training`) lives
in a torch half imported only there. docs/float8.md is the user's page."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.float8.rules import (
    ALL_GATHER_RECIPES,
    PEAK_KEYS,
    all_gather_active,
    emulated,
    enabled,
    fsdp2_sharded,
    peak_key,
)
from loom.float8.schema import RECIPES, Float8Config
from loom.layout import ParallelLayout
from loom.packages import Need

SCHEMAS: dict[str, type] = {name: Float8Config for name in RECIPES}
NEEDS: tuple[Need, ...] = (
    Need("float8=tensorwise, rowwise, rowwise_with_gw_hp or mxfp8", lambda cfg: enabled(cfg), "torchao",
         example=("float8=tensorwise",)),
)


def normalize(cfg: DictConfig) -> None:
    """Nothing to fill: `float8.emulate=null` stays null (the worker decides by the device: `emulated`)."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    """The recipe against the hardware and the strategy (loom.float8.checks): exit 2 naming the fix."""
    from loom.float8.checks import check_float8

    check_float8(cfg, layout)


__all__ = ["ALL_GATHER_RECIPES", "NEEDS", "PEAK_KEYS", "SCHEMAS", "all_gather_active", "check", "emulated",
           "enabled", "fsdp2_sharded", "normalize", "peak_key"]
