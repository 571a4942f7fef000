"""The schema of the `objective` group (conf/objective/): what the training step optimizes.

`lm` is next-token cross-entropy (every run before preference tuning); `dpo`, `ipo` and `simpo`
optimize the policy on preference pairs; `reward` trains a scalar score head on them (Bradley-Terry).
"""

from __future__ import annotations

from dataclasses import dataclass

# objective.reference: where a preference objective's reference log-probs come from. auto: the base
# with the adapters disabled under LoRA (no second copy), else precompute.
REFERENCES = ("auto", "precompute", "online")


@dataclass
class LmObjective:
    name: str = "lm"


@dataclass
class DpoObjective:
    name: str = "dpo"
    beta: float = 0.1              # the KL penalty's strength (DPO's beta)
    label_smoothing: float = 0.0   # conservative DPO: the chance a pair's label is flipped, in [0, 0.5)
    reference: str = "auto"        # auto | precompute | online


@dataclass
class IpoObjective:
    name: str = "ipo"
    beta: float = 0.1              # IPO's tau: the loss pulls the log-ratio margin to 1 / (2 beta)
    reference: str = "auto"        # auto | precompute | online


@dataclass
class SimpoObjective:
    name: str = "simpo"
    beta: float = 2.0              # scales the length-normalized log-probs
    gamma: float = 0.5             # the SimPO paper's target margin (TRL CPOConfig.simpo_gamma)
    label_smoothing: float = 0.0


@dataclass
class RewardObjective:
    name: str = "reward"
    center_rewards_coefficient: float | None = None  # TRL RewardConfig's: + coef * mean((sc + sr)^2)
