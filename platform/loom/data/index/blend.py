"""A weighted mixture's schedule: which source sample k comes from, seekable at any k.

Megatron's BlendedDataset draws each sample from the source whose count lags its weight the
most (the greatest error), so at every prefix of training each source is within one sample of
its share. With rational weights n_j / D (sum n_j = D) that greedy schedule returns to zero
error after D samples and repeats, so one period (D source ids) and each source's positions in
it answer "source of sample k" and "how many of source j before k" in O(log D) for any k,
instead of a stored array as long as training. Weights are read as exact decimals
(`0.7` is 7/10; `1, 1, 1` are thirds); a period longer than MAX_PERIOD is rounded to that
denominator (largest remainders), an error below one sample in MAX_PERIOD per source.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

MAX_PERIOD = 1 << 16


def exact_shares(weights: list[float | int | str]) -> tuple[list[int], int]:
    """(n_j, D): the weights as integer shares of one period D (sum n_j = D)."""
    fr = [Fraction(str(w)) for w in weights]
    total = sum(fr)
    shares = [f / total for f in fr]
    period = math.lcm(*(s.denominator for s in shares))
    if period <= MAX_PERIOD:
        return [int(s * period) for s in shares], period
    raw = [s * MAX_PERIOD for s in shares]
    n = [math.floor(r) for r in raw]
    for j in sorted(range(len(n)), key=lambda j: raw[j] - n[j], reverse=True)[: MAX_PERIOD - sum(n)]:
        n[j] += 1
    return n, MAX_PERIOD


def greedy_period(shares: list[int], period: int) -> np.ndarray:
    """One period of the greatest-error schedule (ties: the lower source number)."""
    counts = [0] * len(shares)
    out = np.empty(period, dtype=np.int32)
    for k in range(period):
        errors = [n * (k + 1) - period * c for n, c in zip(shares, counts, strict=True)]
        j = max(range(len(shares)), key=lambda s: (errors[s], -s))
        counts[j] += 1
        out[k] = j
    return out


class Blend:
    """The schedule of a mixture of len(weights) sources."""

    def __init__(self, weights: list[float | int | str]) -> None:
        self.shares, self.period = exact_shares(weights)
        self.schedule = greedy_period(self.shares, self.period)
        self.positions = [np.flatnonzero(self.schedule == j) for j in range(len(self.shares))]

    def source_of(self, k: int) -> tuple[int, int]:
        """(source j, m): sample k of the blend is the m-th sample drawn from source j."""
        cycle, at = divmod(int(k), self.period)
        j = int(self.schedule[at])
        return j, cycle * self.shares[j] + int(np.searchsorted(self.positions[j], at))

    def counts(self, k: int) -> list[int]:
        """Samples each source gave to the first k samples of the blend."""
        cycle, at = divmod(int(k), self.period)
        return [cycle * n + int(np.searchsorted(p, at)) for n, p in zip(self.shares, self.positions, strict=True)]
