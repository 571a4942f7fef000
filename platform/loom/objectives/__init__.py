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
    check_reference_tokenizer,
)
from loom.objectives.reference import reference_of
from loom.objectives.registry import OBJECTIVES, ObjectiveOption, option_of
from loom.objectives.schema import REFERENCES
from loom.packages import Need

__all__ = ["NEEDS", "OBJECTIVES", "REFERENCES", "SCHEMAS", "ObjectiveOption", "check", "normalize", "option_of", "reference_of"]

SCHEMAS: dict[str, type] = {option.name: option.schema for option in OBJECTIVES.values()}
NEEDS: tuple[Need, ...] = ()


def normalize(cfg: DictConfig) -> None:
    """Nothing to fill: objective.reference=auto stays auto in the frozen config (reference_of says)."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    option = OBJECTIVES[cfg.objective.name]
    check_ranges(cfg.objective)
    check_head(cfg, option)
    check_layout(cfg, option, layout)
    check_reference(cfg, option)
    check_data(cfg, option)
    check_reference_tokenizer(cfg, option)
