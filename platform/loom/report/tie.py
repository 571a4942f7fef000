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
- A trial's noise on a throughput objective: the rate is a mean over its steps, so its noise is
  the standard error of that mean, from the per-step seconds every attempt records (summary.json
  `attempts[-1]`: `step_s_mean`, `step_s_noise`, `timed_steps`; loom.tracking.clock), times sqrt(2)
  for a difference of two such means: value x step_s_noise / step_s_mean / sqrt(timed_steps) x
  sqrt(2). Three timed steps suffice, so a 5-step strategy sweep is judged by its own scatter (a
  0.1% floor alone starred a trial on noise, and identical sweeps on a busy machine flipped).
- On another objective: the step-to-step scatter of its metric over the last NOISE_WINDOW
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
from loom.rundir.paths import RunDir

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
    noise_is: str = "step-to-step noise"  # what `noise` measures, for the report's sentence

    @property
    def ranked_by(self) -> str:
        return "peak memory, then throughput" if self.objective.startswith("throughput.") \
            else "throughput, then peak memory"


def rate_noise(summary: dict, value: float) -> float | None:
    """A throughput value's noise from the last timed attempt's per-step seconds (None: fewer than 3)."""
    timed = next((a for a in reversed(summary.get("attempts") or []) if isinstance(a, dict)
                  and a.get("step_s_noise") is not None and a.get("step_s_mean")), None)
    if timed is None:
        return None
    return abs(value) * timed["step_s_noise"] / timed["step_s_mean"] / math.sqrt(timed["timed_steps"]) * math.sqrt(2)


def trial_noise(r: Run, objective: str, value: float) -> float | None:
    """The trial's noise on the objective: per-step seconds for a rate, else its logged values."""
    if objective.startswith("throughput."):  # every rate (tokens, samples, TFLOP/s, MFU) is steps over time
        found = rate_noise(r.summary, value)
        if found is not None:
            return found
    return noise_of(r.path, objective)


def noise_of(run_dir: Path, objective: str) -> float | None:
    """The trial's step-to-step noise of the objective's metric (None: no column, or too few values)."""
    column = METRIC_COLUMNS.get(objective)
    path = RunDir(run_dir).metrics
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
    noise = max((n for v, r in scored if (n := trial_noise(r, objective, v)) is not None), default=0.0)
    rel = REL_TOL * max(abs(v) for v in values)
    tolerance = max(rel, NOISE_SIGMAS * noise)
    if spread > tolerance:
        return None
    order = sorted((r for _, r in scored), key=lambda r: _key(r, objective))
    timed = objective.startswith("throughput.") and any(rate_noise(r.summary, v) is not None for v, r in scored)
    return Tie(objective, spread, tolerance, noise, NOISE_SIGMAS * noise > rel, order,
               "noise of a difference of their mean rates (per-step seconds)" if timed else "step-to-step noise")
