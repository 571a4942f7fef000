"""Training objectives (conf/objective/: `objective=lm|dpo|ipo|simpo|reward`): what the training step
optimizes. `lm` is next-token cross-entropy (every run's default); the preference objectives train on
pairs (dataset rows of prompt, chosen, rejected) against a reference (dpo, ipo) or without one (simpo),
and `reward` trains a scalar score head with the Bradley-Terry loss.

The package top is torch-free: the schemas, the one-line-per-option registry (registry.py) and the
checks. `losses.py` (torch) holds the losses the worker's training step calls."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.objectives.checks import (
    check_data,
    check_head,
    check_layout,
    check_ranges,
    check_reference,
    dataset_pairs,
)
from loom.objectives.registry import OBJECTIVES, ObjectiveOption
from loom.objectives.schema import REFERENCES
from loom.packages import Need

__all__ = ["NEEDS", "OBJECTIVES", "REFERENCES", "SCHEMAS", "ObjectiveOption", "check", "dataset_pairs",
           "normalize", "option_of", "reference_of"]

SCHEMAS: dict[str, type] = {option.name: option.schema for option in OBJECTIVES.values()}
NEEDS: tuple[Need, ...] = ()


def option_of(cfg: DictConfig) -> ObjectiveOption:
    """The run's objective option (a config frozen before objectives existed: lm)."""
    node = cfg.get("objective")
    return OBJECTIVES[str(node.name) if node is not None else "lm"]


def reference_of(cfg: DictConfig) -> str | None:
    """Where the run's reference log-probs come from: "adapters" (the base with LoRA's adapters
    disabled), "precompute" or "online"; None for an objective without a reference."""
    option = option_of(cfg)
    if not option.reference:
        return None
    ref = str(cfg.objective.reference)
    lora = cfg.model.get("lora")
    if lora and int(lora.get("r") or 0) > 0:  # the base without its adapters is the online reference, at no cost
        return "precompute" if ref == "precompute" else "adapters"
    return "precompute" if ref == "auto" else ref


def normalize(cfg: DictConfig) -> None:
    """Nothing to fill: objective.reference=auto stays auto in the frozen config (reference_of says)."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    option = OBJECTIVES[cfg.objective.name]
    check_ranges(cfg.objective)
    check_head(cfg, option)
    check_layout(cfg, option, layout)
    check_reference(cfg, option)
    check_data(cfg, option)
