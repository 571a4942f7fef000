"""Which rendered pairs of a split train at a sequence length, cut how, and why the others do not.

The stated rule for an overlong pair (`dataset.overlong`): each side must fit seq_len+1 tokens.
`truncate` cuts the prompt from its start (its last tokens kept, the same cut on both sides: they
share it) until the longer side fits, keeping at least the prompt's last token (it predicts the
completion's first); if a completion alone is still too long, that completion's end is cut.
`drop` drops the pair. Either is counted per reason. Torch-free: validation asks it before launch
(a split with nothing to train is refused) and the samples (loom.data.options.preference.samples)
are built from the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAIRS = "pairs.npy"  # per pair: OFF_C, LEN_C, OFF_R, LEN_R, PROMPT, ROW (int64)
OFF_C, LEN_C, OFF_R, LEN_R, PROMPT, ROW = range(6)


@dataclass(frozen=True)
class FittedPairs:
    pairs: np.ndarray   # the pairs kept, as cut: OFF_C, LEN_C, OFF_R, LEN_R (<= seq_len+1), PROMPT, ROW
    total: int          # pairs in the split
    overlong: int       # a side longer than seq_len+1 ...
    dropped: bool       # ... dropped (dataset.overlong=drop), else truncated
    completion_cut: int  # truncated pairs whose completion was cut too (the prompt alone was not enough)

    def reasons(self) -> str:
        """Why pairs left or were cut, for the dataset line and refusals ("" when none)."""
        if not self.overlong:
            return ""
        if self.dropped:
            return f"{self.overlong:,} longer than seq_len+1 dropped"
        also = f" ({self.completion_cut:,} with a completion cut)" if self.completion_cut else ""
        return f"{self.overlong:,} longer than seq_len+1 truncated{also}"

    def trained(self) -> np.ndarray:
        """(kept pairs, 2) trained targets of each side: every token after the shared prompt."""
        first = np.maximum(self.pairs[:, PROMPT], 1)[:, None]  # the first token is never a target
        return self.pairs[:, [LEN_C, LEN_R]] - first


def fit_pairs(pairs: np.ndarray, seq_len: int, overlong: str) -> FittedPairs:
    """The pairs at `seq_len` (`overlong`: truncate | drop), by the module's rule."""
    cap = int(seq_len) + 1
    longest = np.maximum(pairs[:, LEN_C], pairs[:, LEN_R])
    long = longest > cap
    if overlong == "drop":
        return FittedPairs(pairs[~long], len(pairs), int(long.sum()), True, 0)
    kept = pairs.copy()
    cut = np.clip(np.minimum(longest - cap, kept[:, PROMPT] - 1), 0, None)  # from the prompt's start, both sides
    for column in (OFF_C, OFF_R):
        kept[:, column] += cut
    for column in (LEN_C, LEN_R, PROMPT):
        kept[:, column] -= cut
    still = (kept[:, LEN_C] > cap) | (kept[:, LEN_R] > cap)
    kept[:, LEN_C] = np.minimum(kept[:, LEN_C], cap)  # a completion's end cut
    kept[:, LEN_R] = np.minimum(kept[:, LEN_R], cap)
    return FittedPairs(kept, len(pairs), int(long.sum()), False, int(still.sum()))


def fit(split_dir: Path, seq_len: int, overlong: str) -> FittedPairs:
    """The split's pairs at `seq_len`."""
    return fit_pairs(np.load(Path(split_dir) / PAIRS), seq_len, overlong)
