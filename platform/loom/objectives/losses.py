"""The preference losses (torch), written as their formulas, and the log-probs they read.

The training step scores each pair's chosen and rejected completions (`sequence_logps`), fills a
`PairTerms` and calls `pair_loss`, which looks the objective's loss up in the registry. Each loss
returns per-pair losses and rewards; `pair_loss` takes the mean over the pairs (TRL's reduction)
and the metrics TRL logs (rewards/chosen, rewards/rejected, rewards/margin, rewards/accuracy).
Conventions copied from TRL 1.16 (tests/test_objectives.py holds them to it within 1e-5):
DPOTrainer._compute_loss (sigmoid, ipo), CPOTrainer.cpo_loss (simpo, label smoothing),
RewardTrainer.compute_loss (reward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from loom.data.batch import IGNORE_INDEX
from loom.objectives.registry import OBJECTIVES
from loom.schema import load

# (per-pair loss, chosen rewards, rejected rewards), (B,) each
Terms = tuple[Tensor, Tensor, Tensor]


@dataclass
class PairTerms:
    """One entry per pair, (B,) each: what every preference loss is a function of."""

    chosen: Tensor            # the policy's summed log-probs of the chosen completion's targets (reward: its score)
    rejected: Tensor          # ... of the rejected completion's
    chosen_tokens: Tensor     # completion targets counted (float)
    rejected_tokens: Tensor
    ref_chosen: Tensor | None = None    # the reference's summed log-probs (dpo, ipo)
    ref_rejected: Tensor | None = None


def sequence_logps(logits: Tensor, targets: Tensor, used: int | None = None) -> tuple[Tensor, Tensor]:
    """Per row of (N, T, V) logits and (N, T) next-token targets: the sum of the log-softmax at the
    targets that are not IGNORE_INDEX (fp32; the vocabulary cut to the tokenizer's `used` ids first,
    as models/lit.py's _lm_loss does), and the count of those targets (float)."""
    if used is not None and used < logits.shape[-1]:
        logits = logits[..., :used]
    n, t, v = logits.shape
    # cross-entropy per target is -log_softmax at it (0 at IGNORE_INDEX): the fused kernel _lm_loss uses
    nll = F.cross_entropy(logits.reshape(n * t, v).float(), targets.reshape(n * t), reduction="none")
    return -nll.view(n, t).sum(-1), (targets != IGNORE_INDEX).sum(-1).float()


def _references(terms: PairTerms) -> tuple[Tensor, Tensor]:
    if terms.ref_chosen is None or terms.ref_rejected is None:
        raise ValueError("this objective compares the policy to a reference: PairTerms.ref_chosen and ref_rejected")
    return terms.ref_chosen, terms.ref_rejected


def _smoothed(z: Tensor, e: float) -> Tensor:
    """-(1-e) logsig(z) - e logsig(-z): conservative DPO's / cDPO's label smoothing (TRL CPOTrainer.cpo_loss)."""
    return -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)


def dpo(o: DictConfig, t: PairTerms) -> Terms:
    """-(1-e) logsig(b D) - e logsig(-b D), D = (pc - rc) - (pr - rr); rewards b (p - r)."""
    rc, rr = _references(t)
    b, e = float(o.beta), float(o.label_smoothing)
    chosen_ratio, rejected_ratio = t.chosen - rc, t.rejected - rr
    return _smoothed(b * (chosen_ratio - rejected_ratio), e), b * chosen_ratio, b * rejected_ratio


def ipo(o: DictConfig, t: PairTerms) -> Terms:
    """((pc - rc)/nc - (pr - rr)/nr - 1/(2b))^2: TRL's token-normalized IPO (DPOTrainer, loss_type="ipo",
    counts clamped to >= 1 as TRL does); rewards b (p - r) as TRL logs them."""
    rc, rr = _references(t)
    b = float(o.beta)
    chosen_ratio, rejected_ratio = t.chosen - rc, t.rejected - rr
    delta = chosen_ratio / t.chosen_tokens.clamp(min=1.0) - rejected_ratio / t.rejected_tokens.clamp(min=1.0)
    return (delta - 1 / (2 * b)) ** 2, b * chosen_ratio, b * rejected_ratio


def simpo(o: DictConfig, t: PairTerms) -> Terms:
    """-(1-e) logsig(b (pc/nc - pr/nr) - g) - e logsig(-(b (pc/nc - pr/nr) - g)); rewards b p/n
    (TRL CPOTrainer, loss_type="simpo": its simpo_gamma is g). Counts clamped to >= 1 as IPO's (a pair
    whose completion was cut away entirely scores 0, not NaN; TRL divides by the count as it is)."""
    b, g, e = float(o.beta), float(o.gamma), float(o.label_smoothing)
    chosen_mean = t.chosen / t.chosen_tokens.clamp(min=1.0)
    rejected_mean = t.rejected / t.rejected_tokens.clamp(min=1.0)
    return _smoothed(b * (chosen_mean - rejected_mean) - g, e), b * chosen_mean, b * rejected_mean


def reward(o: DictConfig, t: PairTerms) -> Terms:
    """-logsig(sc - sr) (+ coef * mean((sc + sr)^2) when set, TRL RewardTrainer's centering, spread
    over the pairs so the mean adds it once); rewards the scores."""
    sc, sr = t.chosen, t.rejected
    loss = -F.logsigmoid(sc - sr)
    coef = o.get("center_rewards_coefficient")
    if coef is not None:
        loss = loss + float(coef) * ((sc + sr) ** 2).mean()
    return loss, sc, sr


def pair_loss(objective_cfg: DictConfig, terms: PairTerms) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective's loss, the mean over the pairs, and its detached metrics (means over the pairs)."""
    option = OBJECTIVES[str(objective_cfg.name)]
    if option.loss is None:
        raise ValueError(f"objective={option.name} is not a preference objective: it has no pair loss")
    losses, chosen, rejected = load(option.loss)(objective_cfg, terms)
    chosen, rejected = chosen.detach(), rejected.detach()
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/margin": (chosen - rejected).mean(), "rewards/accuracy": (chosen > rejected).float().mean()}
    return losses.mean(), metrics
