"""The training samples of rendered preference pairs (loom.data.options.preference.build's split dirs).

One item per pair: a `Batch` whose `inputs` and `targets` are (2, seq_len), [0] the chosen and [1]
the rejected side, padded; targets are -100 on the shared prompt and the padding, so the trained
targets are exactly the completion's tokens. `reference` is the pair's precomputed reference
log-probs from `self.reference` (set by the training side before the loaders start), else NaN.

The loss of a pair objective is a mean over pairs, so these samples declare no `trained_tokens`:
the sampler hands plain ids and no `loss_scale` applies (chat's global token mean does not).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.data.batch import IGNORE_INDEX, Batch
from loom.data.options.preference.fit import LEN_C, LEN_R, OFF_C, OFF_R, PROMPT, fit


class PreferenceSamples(Dataset):
    def __init__(self, split_dir: Path, name: str, seq_len: int, overlong: str) -> None:
        from loom.data.store import open_store

        self.split_dir = Path(split_dir)  # precomputed reference log-probs are stored beside it
        self.name, self.seq_len, self.overlong_rule = name, int(seq_len), overlong
        self.store = open_store(self.split_dir / "tokens")
        self.fitted = fit(self.split_dir, self.seq_len, overlong)
        self.pairs = self.fitted.pairs
        # what the model sees changes with the rendering (the cache entry's name), seq_len and the cut
        said = f"{self.split_dir.parent.name}/{self.split_dir.name}|{self.seq_len}|{overlong}"
        self.fit_key: str = hashlib.sha1(said.encode()).hexdigest()[:16]
        self.reference: np.ndarray | None = None  # (len, 2) float32 (chosen, rejected), set before loading

    def __len__(self) -> int:
        return len(self.pairs)

    def describe(self, n_val: int) -> str:
        """The dataset line's middle: pairs, trained and masked tokens, overlong and identical ones."""
        tokens = int(self.pairs[:, [LEN_C, LEN_R]].sum())
        trained = int(self.fitted.trained().sum())
        same = int(((self.store.sidecar or {}).get("preference") or {}).get("dropped_identical") or 0)
        gone = "; ".join(r for r in (self.fitted.reasons(), f"{same:,} with identical chosen and rejected dropped"
                                     if same else "") if r)
        cut = f"; {gone}" if gone else ""
        return (f"{self.fitted.total:,} pairs, {tokens:,} tokens: {trained:,} trained, {tokens - trained:,} masked"
                f"{cut} -> {len(self):,} train / {n_val:,} val pairs of 2 x {self.seq_len} tokens")

    def _side(self, off: int, n: int, prompt: int) -> tuple[np.ndarray, np.ndarray]:
        tok = np.zeros(self.seq_len + 1, dtype=np.int64)
        tok[:n] = self.store.read(off, n)
        lab = np.full(self.seq_len + 1, IGNORE_INDEX, dtype=np.int64)
        first = max(prompt, 1)  # the first token trained (the first token is never a target)
        lab[first:n] = tok[first:n]
        return tok[:-1], lab[1:]

    def __getitem__(self, item) -> Batch:
        p = self.pairs[int(item)]
        chosen = self._side(int(p[OFF_C]), int(p[LEN_C]), int(p[PROMPT]))
        rejected = self._side(int(p[OFF_R]), int(p[LEN_R]), int(p[PROMPT]))
        ref = (torch.from_numpy(np.asarray(self.reference[int(item)], dtype=np.float32))
               if self.reference is not None else torch.full((2,), float("nan")))
        return Batch(torch.from_numpy(np.stack([chosen[0], rejected[0]])),
                     torch.from_numpy(np.stack([chosen[1], rejected[1]])),
                     reference=ref, masked=True, pairs=True)


def datasets(cfg):
    """(train, val or None) of the rendered pairs (rendered here where missing)."""
    from loom.data.options.preference.build import stores

    ds = cfg.dataset
    dirs = stores(cfg)
    train = PreferenceSamples(dirs["train"], "preference", ds.seq_len, ds.overlong)
    if len(train) == 0:  # validation refuses this before launch (loom.data.options.preference.build.check_trainable)
        raise ValueError(f"dataset preference: no pair left to train on ({train.fitted.reasons()})")
    val = PreferenceSamples(dirs["val"], "preference", ds.seq_len, ds.overlong)
    return train, (val if len(val) else None)
