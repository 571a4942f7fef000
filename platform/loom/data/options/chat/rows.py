"""Which rendered conversations of a split train at a sequence length, and why the others do not.

A conversation longer than seq_len+1 tokens is truncated or dropped (`dataset.overlong`); one
truncated to no trained target (its prompt alone fills the row) would train nothing and is dropped.
Torch-free: validation asks it before launch (a split with nothing to train is refused, counted
per reason), and the training samples (loom.data.options.chat.samples) are built from the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONVERSATIONS = "conversations.npy"  # per conversation: token offset, length, trained targets


@dataclass(frozen=True)
class FittedRows:
    conv: np.ndarray    # the conversations kept: offset, length (at most seq_len+1), trained targets
    total: int          # conversations in the split
    overlong: int       # longer than seq_len+1 ...
    dropped: bool       # ... dropped (dataset.overlong=drop), else truncated
    untrained: int      # truncated to no trained target: dropped

    def reasons(self) -> str:
        """Why conversations left, for the dataset line and refusals ("" when none did)."""
        said = []
        if self.overlong:
            said.append(f"{self.overlong:,} longer than seq_len+1 {'dropped' if self.dropped else 'truncated'}")
        if self.untrained:
            said.append(f"{self.untrained:,} with no trained token within seq_len+1 dropped")
        return "; ".join(said)


def fit(split_dir: Path, seq_len: int, overlong: str) -> FittedRows:
    """The split's conversations at `seq_len` (`overlong`: truncate | drop)."""
    from loom.data.store import open_store

    conv = np.load(Path(split_dir) / CONVERSATIONS)
    cap = int(seq_len) + 1
    long = conv[:, 1] > cap
    dropped = overlong == "drop"
    kept = conv[~long] if dropped else conv.copy()
    cut = np.nonzero(kept[:, 1] > cap)[0]
    if len(cut):
        mask = open_store(Path(split_dir) / "mask")
        for i in cut:  # truncated: its trained targets within the row
            off = int(kept[i, 0])
            kept[i, 1], kept[i, 2] = cap, int(mask.read(off + 1, cap - 1).sum())
    untrained = kept[:, 2] == 0
    return FittedRows(kept[~untrained], len(conv), int(long.sum()), dropped, int(untrained.sum()))
