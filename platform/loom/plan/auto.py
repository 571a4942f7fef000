"""strategy=auto: the best layout `loom plan --compare` ranks that fits, and why (torch-free).

`choose` returns the validated config of the first fitting candidate (fits first, then the
predicted step to 3 significant figures, then the preset order: least communication and fewest
moving parts first). plan.json `auto_choice` records what it chose, out of how many candidates,
the layouts it tied with, the next one and how much slower its estimate is, and `reason`: the one
line `loom plan` prints under the chosen strategy.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.layout import world_of
from loom.plan.compare import Candidate, compare, rank_key
from loom.plan.memory import GB
from loom.strategies.registry import STRATEGIES

_CHOICES: dict[int, tuple[DictConfig, dict[str, Any]]] = {}  # id(cfg) -> (cfg, plan.json's auto_choice)


def choose(composed: DictConfig) -> DictConfig:
    """strategy=auto: the validated config of the best layout that fits (its concrete strategy
    and degrees in place of auto). None fits: `PlanInfeasible` naming the closest."""
    from loom.errors import PlanInfeasible

    result = compare(composed)
    best = result.candidates[0] if result.candidates else None
    if best is None or not best.fits:
        closest = min(result.candidates, key=lambda c: c.memory_per_device_bytes - (c.capacity_per_device_bytes or 0),
                      default=None)
        where = (f"; the closest is {' '.join(closest.overrides)} needing {closest.memory_per_device_bytes / GB:,.1f}"
                 f" GB of {(closest.capacity_per_device_bytes or 0) / GB:,.1f} GB per device") if closest else ""
        raise PlanInfeasible(
            f"Plan infeasible: strategy=auto found no layout of the {world_of(composed.hardware)}"
            f" devices of hardware={composed.hardware.name} that fits model={composed.model.name}"
            f" ({len(result.candidates)} valid layouts considered){where}. Use more devices, a smaller"
            " dataset.batch_size or trainer.activation_checkpointing=full; `loom plan --compare` lists them.")
    fitting = [c for c in result.candidates if c.fits]
    tied, runner = _tied_and_next(fitting)
    choice = {"strategy": best.strategy, "degrees": best.degrees, "overrides": best.overrides,
              "predicted_step_s": best.predicted_step_s, "candidates_considered": len(result.candidates),
              "candidates_fitting": len(fitting), "tied_with": [label(c) for c in tied],
              "runner_up": label(runner) if runner else None,
              "runner_up_slower_by": _slower_by(best, runner) if runner else None,
              "reason": auto_reason(best, fitting, len(result.candidates)),
              "rate_source": result.rate_source, "bandwidth_source": result.bandwidth_source}
    _CHOICES[id(best.cfg)] = (best.cfg, choice)
    return best.cfg


def label(c: Candidate) -> str:
    """A layout in a few words: the preset's name, with the degrees the name leaves open
    ("fsdp_tp tp=2", "nd dp_replicate=2 dp_shard=4", "fsdp cp=8"; degrees of 1 left out)."""
    keys = STRATEGIES[c.strategy].open_degrees  # the others follow from the world
    degrees = " ".join(f"{k}={c.degrees[k]}" for k in keys if c.degrees.get(k, 1) != 1)
    degrees += f" cp={c.cp}" + (f" ({c.cp_style})" if c.cp_style == "ring" else "") if c.cp > 1 else ""
    return f"{c.strategy} {degrees}".strip()


def _tied_and_next(fitting: list[Candidate]) -> tuple[list[Candidate], Candidate | None]:
    """The fitting layouts after the first that rank equal to it (`_rank`: the same predicted step
    to 3 significant figures), and the first that ranks below it (None: there is none)."""
    if not fitting:
        return [], None
    first = rank_key(fitting[0])
    tied = [c for c in fitting[1:] if rank_key(c) == first]
    rest = [c for c in fitting[1:] if rank_key(c) != first]
    return tied, rest[0] if rest else None


def _slower_by(best: Candidate, other: Candidate) -> float | None:
    """How much slower `other`'s predicted step is than `best`'s, as a fraction (None: unknown)."""
    if not best.predicted_step_s or other.predicted_step_s is None:
        return None
    return other.predicted_step_s / best.predicted_step_s - 1.0


def auto_reason(best: Candidate, fitting: list[Candidate], considered: int) -> str:
    """strategy=auto's one line: why this layout, out of how many ("fastest estimated step (0.236 s)
    among 27 layouts that fit, of 30 valid; tied with zero3 (listed first: fewer moving parts);
    the next, fsdp_tp tp=2, 2.5% slower")."""
    of = f"among {len(fitting)} layout(s) that fit, of {considered} valid"
    if best.predicted_step_s is None:  # no FLOP count (a custom model): the preset order decides
        return f"the first in preset order (least communication first) {of}; no step estimate (FLOPs unknown)"
    if len(fitting) == 1:
        return (f"the only layout that fits, of {considered} valid (estimated step {best.predicted_step_s:.3g} s)"
                + _context_note(best))
    line = f"fastest estimated step ({best.predicted_step_s:.3g} s) {of}"
    tied, runner = _tied_and_next(fitting)
    if tied:
        line += f"; tied with {', '.join(label(c) for c in tied)} (listed first: fewer moving parts)"
    slower = _slower_by(best, runner) if runner else None
    if runner is not None and slower is not None:
        line += f"; the next, {label(runner)}, {slower:.1%} slower"
    return line + _context_note(best)


def _context_note(best: Candidate) -> str:
    """A context-parallel choice says what cp does for it (`plan.compare._note_context`)."""
    return f"; {best.note}" if best.cp > 1 and best.note else ""


def auto_choice_of(cfg: DictConfig) -> dict[str, Any] | None:
    """plan.json's `auto_choice` of a config `choose` returned (None: not chosen by auto)."""
    held = _CHOICES.get(id(cfg))
    return held[1] if held and held[0] is cfg else None
