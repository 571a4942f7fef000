"""What the other stages ask of the float8 setting (torch-free): whether it is on, emulated, all-gathered
in float8, and which peak its matmuls run at."""

from __future__ import annotations

from omegaconf import DictConfig

from loom import strategies
from loom.float8.schema import RECIPES
from loom.layout import ParallelLayout

# The recipes whose scales are one per tensor: the only ones torchao all-gathers in float8 under FSDP2
# (`enable_fsdp_float8_all_gather` asserts tensorwise scaling).
ALL_GATHER_RECIPES = ("tensorwise",)
# `hardware.peak_tflops` key of the matmuls each recipe runs on a GPU (MX block scales: their own peak).
PEAK_KEYS = {"tensorwise": "fp8", "rowwise": "fp8", "rowwise_with_gw_hp": "fp8", "mxfp8": "mxfp8"}


def enabled(cfg: DictConfig) -> bool:
    """Whether the run trains in float8 (any recipe but none)."""
    node = cfg.get("float8") or {}
    return RECIPES.get(str(node.get("name", "none"))) is not None


def emulated(cfg: DictConfig) -> bool:
    """Whether the float8 matmuls are emulated (torchao's `emulate=True`: cast to float8 and back, the
    matmul in high precision): `float8.emulate`, or by default on every accelerator but a GPU."""
    return emulates(cfg.float8.get("emulate"), on_gpu=cfg.hardware.accelerator == "gpu")


def emulates(flag: bool | None, on_gpu: bool) -> bool:
    """The one rule, for the plan (by the profile's accelerator) and the worker (by the model's device):
    `float8.emulate` when set, else everywhere but on a GPU."""
    return bool(flag) if flag is not None else not on_gpu


def fsdp2_sharded(cfg: DictConfig, layout: ParallelLayout) -> bool:
    """Whether FSDP2 all-gathers the weights: a strategy whose mixed precision is FSDP2's, with states
    sharded over more than one rank (dp_shard x cp)."""
    return strategies.option(cfg.strategy.name).mixed_precision == "fsdp2" and layout.dp_shard * layout.cp > 1


def all_gather_active(cfg: DictConfig, layout: ParallelLayout) -> bool:
    """`float8.all_gather` as the run applies it: FSDP2 all-gathers the converted weights in float8 (torchao's
    `enable_fsdp_float8_all_gather`) only for a tensorwise recipe under sharded FSDP2; elsewhere it is ignored
    (a plan warning says so). The worker passes this, not the raw flag, to torchao."""
    return (enabled(cfg) and bool(cfg.float8.all_gather) and cfg.float8.name in ALL_GATHER_RECIPES
            and fsdp2_sharded(cfg, layout))


def peak_key(cfg: DictConfig) -> str | None:
    """The `hardware.peak_tflops` key MFU is measured against when the run trains in float8 (fp8, mxfp8);
    None: no float8, or emulated (the matmuls run in hardware.precision, and so does its peak)."""
    if not enabled(cfg) or emulated(cfg):
        return None
    return PEAK_KEYS[cfg.float8.name]
