"""`dataset=preference`: pairs rendered with the chat template into one token store (each pair's
chosen then rejected side) plus `pairs.npy` (offsets, lengths, the shared prompt's length, the source
row), once, cached by inputs, template and tokenizer as dataset=chat's stores are. Every row is
rendered when the config is checked, before the run dir exists, so a row that cannot be trained (no
chosen or rejected, a side that is neither a string nor messages, a template that cannot render the
pair) stops the launch with exit 2, naming the rows; so do identical chosen and rejected under
`dataset.identical=refuse` (`drop`: a warning, counted in the dataset line), and a split left with
nothing to train. How a pair longer than seq_len+1 is cut or dropped: loom.data.options.preference.fit.
No torch here.

    loom train recipe=dpo dataset.path=/data/prefs.jsonl dataset.tokenizer=/models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from loom.data.conversation.front import cache_entry, check_front, render_splits
from loom.data.conversation.render import RowError
from loom.data.conversation.source import rows as source_rows
from loom.data.conversation.source import write_whole
from loom.data.conversation.template import ChatTemplate, TemplateError
from loom.data.options.preference.fit import LEN_C, LEN_R, PAIRS, fit
from loom.data.options.preference.pairs import RenderedPair, pair_of, render_pair
from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout

log = logging.getLogger("loom")
OVERLONG = ("truncate", "drop")
IDENTICAL = ("drop", "refuse")  # chosen == rejected: dropped (warned, counted) | refused (named)
SPLITS = ("train", "val")
SHOWN = 5  # bad rows named in the error


def _columns(ds: DictConfig) -> tuple[str, str, str]:
    return str(ds.prompt_column), str(ds.chosen_column), str(ds.rejected_column)


def check_preference(cfg: DictConfig, layout: ParallelLayout) -> None:
    """The fields, the tokenizer and its template, then every row rendered (once, cached)."""
    ds = cfg.dataset
    for key, value, choices in (("overlong", ds.overlong, OVERLONG), ("identical", ds.identical, IDENTICAL)):
        if value not in choices:
            fail(f"dataset.{key}", value, f"valid choices: {', '.join(choices)}")
    check_front(ds, layout, "pairs: JSON lines / parquet files (a glob works) or a save_to_disk directory, each row "
                "with prompt, chosen and rejected (strings or lists of messages), or chosen and rejected as whole "
                "conversations sharing the prompt", "trains a loss over each pair's two sequences, which the "
                "pipeline schedules do not compute", [[{"role": "user", "content": "hi"}],
                                                      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]])
    dirs = stores(cfg)  # every row rendered (once, cached) before anything is written: bad rows exit 2 here
    check_trainable(ds, dirs["train"])


def check_trainable(ds: DictConfig, train_dir: Path) -> None:
    """A train split with no pair left at dataset.seq_len is refused, counted per reason."""
    pairs = fit(train_dir, ds.seq_len, ds.overlong)
    if len(pairs.pairs):
        return
    raw = np.load(train_dir / PAIRS)
    longest = int(raw[:, [LEN_C, LEN_R]].max(initial=0))
    fail("dataset.seq_len", ds.seq_len, f"no pair of the {pairs.total:,} in the train split fits seq_len+1 tokens "
         f"({pairs.reasons() or 'the split is empty'}); the longest side is {longest:,} tokens: raise "
         "dataset.seq_len" + (" or set dataset.overlong=truncate" if pairs.dropped and pairs.overlong else ""))


def source(ds: DictConfig) -> str:
    return f"{ds.path or ds.hub} ({'/'.join(_columns(ds))})"


def store_root(ds: DictConfig) -> Path:
    """The cache entry of the rendered pairs (its train/ and val/ are the samples' split dirs)."""
    return cache_entry(ds, "preference", ("pairs", *_columns(ds), ds.val_every, ds.get("max_docs"), ds.identical))


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, Path]:
    """{split: its directory}, rendered into the cache where missing (ConfigError: bad rows)."""
    ds = cfg.dataset
    root = store_root(ds)
    if not _complete(root):
        write_whole(root, _complete, lambda tmp: _render_rows(ds, tmp))
    return {s: root / s for s in SPLITS}


def pair_count(cfg: DictConfig) -> int | None:
    """Pairs of the train and validation splits at dataset.seq_len, once rendered (None: not yet)."""
    ds = cfg.dataset
    root = store_root(ds)
    if not _complete(root):
        return None
    return sum(len(fit(root / s, ds.seq_len, ds.overlong).pairs) for s in SPLITS)


def _complete(root: Path) -> bool:
    from loom.data.store import SIDECAR

    return all((root / s / "tokens" / SIDECAR).is_file() for s in SPLITS)


def _render_rows(ds: DictConfig, root: Path) -> None:
    render_splits(ds, root, SPLITS, _SplitWriter, _render_into)


def _pair(ds: DictConfig, row: dict, template: ChatTemplate, tokenizer: Any) -> RenderedPair | None:
    """The row's pair rendered, or None when its chosen and rejected are identical (and dropped)."""
    prompt, chosen, rejected = _columns(ds)
    pair = pair_of(row, prompt, chosen, rejected)
    if pair.identical:
        if ds.identical == "refuse":
            raise RowError(f"its '{chosen}' and '{rejected}' are identical: the pair prefers nothing "
                           "(dataset.identical=drop drops such rows, counted)")
        return None
    return render_pair(template, tokenizer, pair, (chosen, rejected))


def _render_into(ds: DictConfig, out: dict[str, _SplitWriter], template: ChatTemplate, tokenizer: Any) -> int:
    """Every row into its split's writer (row i is validation when i % val_every == val_every-1);
    returns the rows dropped as identical (ConfigError: rows that cannot be trained, or none to train)."""
    bad: list[str] = []
    same: list[int] = []  # the first identical rows, for the warning
    n_bad = n_rows = n_same = 0
    every = int(ds.val_every or 0)
    log.info(f"dataset preference: rendering {ds.path or ds.hub} with {template.source} (once)")
    for i, row in source_rows(ds):
        n_rows += 1
        try:
            rendered = _pair(ds, row, template, tokenizer)
        except (RowError, TemplateError) as e:
            n_bad += 1
            if len(bad) < SHOWN:
                bad.append(f"row {i}: {e}")
            continue
        if rendered is None:
            n_same += 1
            same += [i] if len(same) < SHOWN else []
            continue
        out["val" if every > 1 and i % every == every - 1 else "train"].add(rendered, i)
    where = f"dataset.path={ds.path or ds.hub}"
    if n_bad:
        raise ConfigError(f"Invalid config: {where}: {n_bad:,} of {n_rows:,} rows cannot be trained (nothing was "
                          "written). " + "; ".join(bad) + ("; ..." if n_bad > len(bad) else ""))
    if n_same:
        rows = ", ".join(map(str, same)) + (", ..." if n_same > len(same) else "")
        log.warning(f"warning: {where}: {n_same:,} of {n_rows:,} rows with identical chosen and rejected dropped "
                    f"(rows {rows}; dataset.identical=refuse refuses them)")
    if out["train"].n == 0:
        gone = f" ({n_same:,} with identical chosen and rejected dropped)" if n_same else ""
        raise ConfigError(f"Invalid config: {where}: no pair to train on: {n_rows:,} rows{gone} (nothing was written)")
    return n_same


class _SplitWriter:
    """The tokens store of one split (each pair's chosen, then rejected, side) and its pairs array."""

    def __init__(self, d: Path, spec: Any) -> None:
        import shutil

        from loom.data.store import ShardWriter

        shutil.rmtree(d, ignore_errors=True)
        self.d, self.spec = d, spec
        self.tokens = ShardWriter(d / "tokens" / "part-00000", spec.dtype)
        self.rows: list[tuple[int, ...]] = []
        self.offset = 0

    @property
    def n(self) -> int:
        return len(self.rows)

    def abort(self) -> None:
        self.tokens.abort()

    def add(self, r: RenderedPair, row: int) -> None:
        self.tokens.add_document(r.chosen)
        self.tokens.add_document(r.rejected)
        c, n_c, n_r = self.offset, len(r.chosen), len(r.rejected)
        self.rows.append((c, n_c, c + n_c, n_r, r.prompt, row))
        self.offset += n_c + n_r

    def finish(self, ds: DictConfig, template: ChatTemplate, split: str, identical: int) -> None:
        from loom.atomic import atomic_path
        from loom.data.store import write_sidecar

        self.tokens.finish()
        with atomic_path(self.d / PAIRS) as tmp, open(tmp, "wb") as f:
            np.save(f, np.asarray(self.rows, dtype=np.int64).reshape(-1, 6))
        s = self.spec
        info = {"template": template.source, "pairs": self.n, "split": split,
                "dropped_identical": identical}  # of the whole source (rows are dropped before the split)
        write_sidecar(self.d / "tokens", {
            "format": "loom-token-store", "version": 1, "shards": ["part-00000"], "documents": 2 * self.n,
            "tokens": self.offset, "sources": [{"path": str(ds.path or ds.hub)}], "preference": info,
            "tokenizer": s.name, "tokenizer_fingerprint": s.fingerprint, "vocab_size": s.vocab_size,
            "eos_id": s.eos_id, "dtype": s.dtype})
