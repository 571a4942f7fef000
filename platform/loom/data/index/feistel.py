"""A seekable pseudo-random permutation of [0, n): element i of the shuffle in O(1), for any i.

Why not `torch.randperm(n)`: its list, held by every rank, is ~4 GB at 5e7 samples (LESSONS,
"Data at scale"). A 4-round Feistel network over the smallest even-bit domain 2^(2h) >= n is a
bijection of that domain; cycle walking (apply again while the value is >= n) makes it one of
[0, n), at most 4x the domain, so ~2 extra rounds on average. The round function is the
splitmix64 finalizer keyed per round from the seed: deterministic everywhere (numpy uint64
arithmetic wraps the same on every machine).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective avalanche of 64-bit values (uint64 arrays, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def seed_key(*parts: int) -> int:
    """One 64-bit key from several integers (seed, source, epoch, ...), order-sensitive."""
    h = np.array([0x9E3779B97F4A7C15], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            h = mix64(h ^ np.array([int(p) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return int(h[0])


_U64 = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """mix64 on one Python int: the same values, without numpy's per-call cost (a sample's
    lookup is one call; arrays go through mix64)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


class Permutation:
    """`perm(i)` for an int or an integer array: the image of i under the seed's permutation."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = int(n)
        bits = max(2, int(self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.int_keys = [seed_key(seed, r) for r in range(ROUNDS)]
        self.keys = [np.uint64(k) for k in self.int_keys]

    def _rounds(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ key) & self.mask)
        return (left << h) | right

    def _one(self, x: int) -> int:
        keys, half, mask = self.int_keys, self.half, int(self.mask)
        while True:
            left, right = x >> half, x & mask
            for key in keys:
                left, right = right, left ^ (_mix_int(right ^ key) & mask)
            x = (left << half) | right
            if x < self.n:
                return x

    def __call__(self, i):
        if isinstance(i, int | np.integer) and self.n > 1:
            return self._one(int(i))
        scalar = np.isscalar(i)
        x = np.atleast_1d(np.asarray(i, dtype=np.uint64))
        if self.n <= 1:
            return int(x[0]) if scalar else x.astype(np.int64)
        with np.errstate(over="ignore"):
            x = self._rounds(x)
            out = x >= np.uint64(self.n)
            while out.any():  # cycle walking: at most a few rounds (domain < 4n)
                x[out] = self._rounds(x[out])
                out = x >= np.uint64(self.n)
        y = x.astype(np.int64)
        return int(y[0]) if scalar else y
