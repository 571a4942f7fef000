"""One registry of the objective options: each `objective=` option -> its `ObjectiveOption`.

Adding an objective = its schema in schema.py, its loss in losses.py, its yaml in conf/objective/,
and one line here. Everything else asks the option object, never the objective's name. Torch-free:
the loss is named "module:function" and imported by the worker only (loom.schema.load).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from loom.objectives.schema import DpoObjective, IpoObjective, LmObjective, RewardObjective, SimpoObjective


@dataclass(frozen=True)
class ObjectiveOption:
    schema: type
    pairs: bool        # trains on preference pairs (a dataset whose DatasetOption has `pairs`)
    reference: bool    # compares the policy to a reference model (objective.reference)
    # "module:function" (cfg, PairTerms) -> (per-pair loss, chosen rewards, rejected rewards), (B,) each;
    # None: the model's own loss (lm)
    loss: str | None = None
    score_head: bool = False  # trains a scalar score head (model.head=score), not the LM head

    @property
    def name(self) -> str:
        """`objective=<name>`: its schema's `name` default (conf/objective/<name>.yaml)."""
        return str(self.schema.name)


LOSSES = "loom.objectives.losses"
OPTIONS: tuple[ObjectiveOption, ...] = (
    ObjectiveOption(LmObjective, pairs=False, reference=False),
    ObjectiveOption(DpoObjective, pairs=True, reference=True, loss=f"{LOSSES}:dpo"),
    ObjectiveOption(IpoObjective, pairs=True, reference=True, loss=f"{LOSSES}:ipo"),
    ObjectiveOption(SimpoObjective, pairs=True, reference=False, loss=f"{LOSSES}:simpo"),
    ObjectiveOption(RewardObjective, pairs=True, reference=False, loss=f"{LOSSES}:reward", score_head=True),
)
OBJECTIVES: dict[str, ObjectiveOption] = {option.name: option for option in OPTIONS}


def option_of(cfg: DictConfig) -> ObjectiveOption:
    """The run's objective option (a config frozen before objectives existed: lm)."""
    node = cfg.get("objective")
    return OBJECTIVES[str(node.name) if node is not None else "lm"]
