"""Whether a sweep's trials tie on their objective, and their order when they do.

Loom's strategies, hardware profiles and layouts train the same losses by design (the parity
tests), so a sweep over them that ranks by final loss would star whichever trial float summation
order favoured. The trials tie when the spread of their objective values (largest - smallest)
is within

    tolerance = max(REL_TOL x the largest |value|, NOISE_SIGMAS x the largest trial noise)

- REL_TOL = 1e-3: what summation order alone moves a loss. Two strategies agree to ~1e-7 at step
  1 (test_strategies holds them to 1e-4), and Adam's normalized steps let that drift grow with
  the steps; a real difference (another learning rate, other data, another model) moves a loss
  by 1e-2 or more within a few steps.
- A trial's noise: the step-to-step scatter of the objective's metric over its last NOISE_WINDOW
  logged values (metrics.csv), estimated as std(successive differences) / sqrt(2) (von Neumann):
  differencing cancels a smooth trend, such as a loss still falling, that a plain standard
  deviation would count as noise. A final value is one draw of that scatter, so two trials whose
  values differ by less than NOISE_SIGMAS of it cannot be told apart by this sweep. Fewer than
  NOISE_MIN logged values (a 3-step run): no estimate, REL_TOL alone.

Tied trials are ranked by throughput (higher first), then peak memory (lower first): what differs
between them. When the objective is throughput itself, by peak memory, then throughput.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from loom.report.runs import Run

REL_TOL = 1e-3
NOISE_SIGMAS = 2.0
NOISE_WINDOW = 8
NOISE_MIN = 5
# summary.json objective -> the metrics.csv column logged at every log step (none: no noise estimate)
METRIC_COLUMNS = {"final_loss": "train/loss", "validation.loss": "val/loss", "validation.acc": "val/acc",
                  "throughput.tokens_per_sec": "perf/tokens_per_sec",
                  "throughput.samples_per_sec": "perf/samples_per_sec", "throughput.mfu": "perf/mfu",
                  "throughput.tflops_per_device": "perf/tflops_per_device"}


@dataclass
class Tie:
    """Every completed trial is within `tolerance` of the others on the objective."""

    objective: str
    spread: float           # largest - smallest objective value
    tolerance: float
    noise: float            # the largest trial noise (0.0: none could be estimated)
    by_noise: bool          # the tolerance is NOISE_SIGMAS x noise (else REL_TOL x value)
    order: list[Run] = field(default_factory=list)  # the tied trials, best first by `ranked_by`

    @property
    def ranked_by(self) -> str:
        return "peak memory, then throughput" if self.objective.startswith("throughput.") \
            else "throughput, then peak memory"


def noise_of(run_dir: Path, objective: str) -> float | None:
    """The trial's step-to-step noise of the objective's metric (None: no column, or too few values)."""
    column = METRIC_COLUMNS.get(objective)
    path = run_dir / "metrics.csv"
    if column is None or not path.is_file():
        return None
    by_step: dict[int, float] = {}
    try:
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                value, step = row.get(column), row.get("step")
                if value not in (None, "") and step not in (None, ""):
                    by_step[int(float(step))] = float(value)  # a resume's replayed step: the last one
    except (OSError, ValueError, csv.Error):
        return None
    values = [by_step[s] for s in sorted(by_step)][-NOISE_WINDOW:]
    if len(values) < NOISE_MIN or not all(math.isfinite(v) for v in values):
        return None
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return math.sqrt(var / 2)


def _key(r: Run, objective: str) -> tuple[float, float]:
    """Sort key of a tied trial: throughput (higher first) and peak memory (lower first); unknown last."""
    rate = -r.rate if r.rate is not None else math.inf
    mem = r.peak_memory()[0]
    mem = mem if mem is not None else math.inf
    return (mem, rate) if objective.startswith("throughput.") else (rate, mem)


def tie_of(scored: list[tuple[float, Run]], objective: str) -> Tie | None:
    """The tie of these (objective value, completed run) pairs, None when they differ (or fewer than 2)."""
    if len(scored) < 2:
        return None
    values = [v for v, _ in scored]
    spread = max(values) - min(values)
    noise = max((n for _, r in scored if (n := noise_of(r.path, objective)) is not None), default=0.0)
    rel = REL_TOL * max(abs(v) for v in values)
    tolerance = max(rel, NOISE_SIGMAS * noise)
    if spread > tolerance:
        return None
    order = sorted((r for _, r in scored), key=lambda r: _key(r, objective))
    return Tie(objective, spread, tolerance, noise, NOISE_SIGMAS * noise > rel, order)
