"""float8 training (conf/float8/: `float8=none|tensorwise|rowwise|rowwise_with_gw_hp|mxfp8`): the model's
Linear layers compute in float8 through torchao, beside `hardware.precision` for the rest.

The package top is torch-free (the schema, the checks, what the plan asks); the worker's conversion
(torchao's `convert_to_float8_training`) lives in a torch half imported only there."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.float8.schema import RECIPES, Float8Config
from loom.layout import ParallelLayout
from loom.packages import Need

SCHEMAS: dict[str, type] = {name: Float8Config for name in RECIPES}
NEEDS: tuple[Need, ...] = (
    Need("float8=tensorwise|rowwise|rowwise_with_gw_hp|mxfp8", lambda cfg: enabled(cfg), "torchao",
         example=("float8=tensorwise",)),
)


def enabled(cfg: DictConfig) -> bool:
    """Whether the run trains in float8 (any recipe but none)."""
    node = cfg.get("float8") or {}
    return RECIPES.get(str(node.get("name", "none"))) is not None


def normalize(cfg: DictConfig) -> None:
    """Nothing to fill: `float8.emulate=null` stays null (the worker decides by the device)."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Filled in by the float8 checks (recipe, hardware, strategy)."""
