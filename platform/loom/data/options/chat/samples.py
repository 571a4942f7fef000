"""The training samples of rendered conversations (loom.data.options.chat.build's split directories).

`packing=padded`: one conversation per row, padded to seq_len. `packing=documents`: whole
conversations packed greedily, in store order, into rows of seq_len+1 tokens (never split, so
a conversation keeps its prompt), positions restarting at each conversation (the models'
document masks: no attention across conversations). A conversation longer than seq_len+1 is
truncated or dropped (`dataset.overlong`), one truncated to nothing trained is dropped, each counted
(loom.data.options.chat.rows).

Every sample is a `loom.data.batch.Batch`: `inputs`, `targets` (-100 where not trained: prompt tokens,
padding, a target across a conversation boundary), `loss_scale`, and under documents packing `positions`.
`loss_scale` makes the loss the mean over the trained targets of the whole global batch, whatever
the packing, the ranks and the accumulation (transformers PR #34191, TRL #2604): the sampler
knows the global batch each micro batch belongs to and hands each sample id with
(micro batches per step) / (trained targets in the global batch), so that each micro batch's
summed loss x scale, averaged over the micro batches and ranks as DDP, FSDP and DeepSpeed do,
is the global token mean. A sample read without one (validation) gets NaN: its batch's own mean.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.data.batch import Batch
from loom.data.index.windows import IGNORE
from loom.data.options.chat.rows import fit


def pack(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """First conversation of each row when packing in order, whole, into rows of `capacity` tokens
    (a Python loop over conversations, once per dataset: ~1 s per million)."""
    starts, used = [], capacity
    for i, n in enumerate(lengths.tolist()):
        if used + n > capacity:
            starts.append(i)
            used = 0
        used += n
    return np.asarray(starts, dtype=np.int64)


class ChatSamples(Dataset):
    def __init__(self, split_dir: Path, name: str, seq_len: int, packing: str, overlong: str) -> None:
        from loom.data.store import open_store

        self.name, self.seq_len, self.documents = name, int(seq_len), packing == "documents"
        self.store = open_store(Path(split_dir) / "tokens")
        self.mask = open_store(Path(split_dir) / "mask")
        self.fitted = fit(split_dir, self.seq_len, overlong)
        self.overlong, self.dropped, self.untrained = self.fitted.overlong, self.fitted.dropped, self.fitted.untrained
        conv = self.conv = self.fitted.conv
        cap = self.seq_len + 1
        if self.documents:
            self.rows = pack(conv[:, 1], cap)
            self.row_trained = np.add.reduceat(conv[:, 2], self.rows) if len(self.rows) else self.rows
        else:
            self.rows, self.row_trained = np.arange(len(conv)), conv[:, 2]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def trained_targets(self) -> int:
        return int(self.conv[:, 2].sum())

    def describe(self, n_val: int) -> str:
        """The dataset line's middle: conversations, trained and masked tokens, overlong ones."""
        tokens, trained = int(self.conv[:, 1].sum()), self.trained_targets
        empty = int(((self.store.sidecar or {}).get("chat") or {}).get("dropped_empty_replies") or 0)
        gone = "; ".join(r for r in (self.fitted.reasons(), f"{empty:,} with an empty assistant reply dropped"
                                     if empty else "") if r)
        cut = f"; {gone}" if gone else ""
        rows = "rows of whole conversations packed apart" if self.documents else "padded rows, one conversation each"
        return (f"{len(self.conv):,} conversations, {tokens:,} tokens: {trained:,} trained, {tokens - trained:,} "
                f"masked{cut} -> {len(self):,} train / {n_val:,} val {rows} of {self.seq_len} tokens")

    def trained_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Trained targets of samples `ids` (the sampler's global-batch normalizer)."""
        return self.row_trained[ids]

    def _conversations(self, i: int) -> range:
        first = int(self.rows[i])
        last = int(self.rows[i + 1]) if i + 1 < len(self.rows) else len(self.conv)
        return range(first, last if self.documents else first + 1)

    def __getitem__(self, item) -> Batch:
        i, scale = (int(item[0]), float(item[1])) if isinstance(item, tuple | list) else (int(item), float("nan"))
        ids, labels, pos = [], [], []
        for c in self._conversations(i):
            off, n = int(self.conv[c, 0]), int(self.conv[c, 1])
            tok = self.store.read(off, n).astype(np.int64)
            trained = self.mask.read(off, n).astype(bool)
            lab = np.where(trained, tok, IGNORE)
            lab[0] = IGNORE  # no target crosses into this conversation from the one before
            ids.append(tok)
            labels.append(lab)
            pos.append(np.arange(n, dtype=np.int64))
        tok, lab, p = np.concatenate(ids), np.concatenate(labels), np.concatenate(pos)
        pad = self.seq_len + 1 - len(tok)
        tok = np.concatenate([tok, np.zeros(pad, dtype=np.int64)])
        lab = np.concatenate([lab, np.full(pad, IGNORE, dtype=np.int64)])
        p = np.concatenate([p, np.arange(pad, dtype=np.int64)])  # padding: its own document
        return Batch(torch.from_numpy(tok[:-1]), torch.from_numpy(lab[1:].copy()),
                     torch.from_numpy(p[:-1].copy()) if self.documents else None,
                     torch.tensor(scale, dtype=torch.float32), masked=True)


def datasets(cfg):
    """(train, val or None) of the rendered conversations (rendered here where missing)."""
    from loom.data.options.chat.build import stores

    ds = cfg.dataset
    dirs = stores(cfg)
    train = ChatSamples(dirs["train"], "chat", ds.seq_len, ds.packing, ds.overlong)
    if len(train) == 0:  # validation refuses this before launch (loom.data.options.chat.build.check_trainable)
        raise ValueError(f"dataset chat: no conversation left to train on ({train.fitted.reasons()})")
    val = ChatSamples(dirs["val"], "chat", ds.seq_len, ds.packing, ds.overlong)
    return train, (val if len(val) else None)
