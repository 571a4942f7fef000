"""`dataset=chat`: conversations rendered with the chat template into two aligned token stores
(the tokens, and a 0/1 store of which are trained) plus `conversations.npy` (each one's
offset, length and trained targets), once, cached by inputs, template and tokenizer. Every row
is rendered when the config is checked, before the run dir exists (a later run finds the cache;
a SLURM job's rank 0 renders in `prepare_data` where it is missing), so a row that cannot be
trained (no messages, a non-string content, an unknown role, a template that rewrites earlier
turns, nothing to train) stops the launch with exit 2, naming the rows, and so does a split
left with nothing to train at dataset.seq_len (counted per reason: loom.data.options.chat.rows). A row
with an empty assistant reply is dropped and counted, or refused (`dataset.empty_replies`). The
stores are written beside the cache entry and renamed into it when whole: a refused or
interrupted render leaves nothing in the cache. No torch here.

    loom train recipe=sft dataset.path=/data/chats.jsonl dataset.tokenizer=/models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from loom.data.conversation.front import cache_entry, check_front, render_splits
from loom.data.conversation.render import FORMATS, TRAIN_ON, RowError, conversation, render
from loom.data.conversation.source import rows as source_rows
from loom.data.conversation.source import write_whole
from loom.data.conversation.template import ChatTemplate, TemplateError
from loom.data.options.chat.rows import CONVERSATIONS, fit
from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout

log = logging.getLogger("loom")
PACKINGS = ("padded", "documents")
OVERLONG = ("truncate", "drop")
EMPTY_REPLIES = ("drop", "refuse")  # a row whose assistant reply is empty: dropped (counted) | refused
SPLITS = ("train", "val")
SHOWN = 5  # bad rows named in the error


def check_chat(cfg: DictConfig, layout: ParallelLayout) -> None:
    """The fields, the tokenizer and its template (rendering the first row), in a second."""
    ds = cfg.dataset
    for key, value, choices in (("format", ds.format, FORMATS), ("train_on", ds.train_on, TRAIN_ON),
                                ("packing", ds.packing, PACKINGS), ("overlong", ds.overlong, OVERLONG),
                                ("empty_replies", ds.empty_replies, EMPTY_REPLIES)):
        if value not in choices:
            fail(f"dataset.{key}", value, f"valid choices: {', '.join(choices)}")
    check_front(ds, layout, "conversations: JSON lines / parquet files (a glob works) or a save_to_disk directory, "
                "each row with a 'messages' list (or prompt/completion with dataset.format=prompt_completion)",
                "trains with a loss over the global batch's trained tokens, which the pipeline schedules do not "
                "compute yet", [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]])
    dirs = stores(cfg)  # every row rendered (once, cached) before anything is written: bad rows exit 2 here
    check_trainable(ds, dirs["train"])


def check_trainable(ds: DictConfig, train_dir: Path) -> None:
    """A train split with no conversation left to train at dataset.seq_len is refused, counted per reason."""
    rows = fit(train_dir, ds.seq_len, ds.overlong)
    if len(rows.conv):
        return
    longest = int(np.load(train_dir / CONVERSATIONS)[:, 1].max(initial=0))
    fail("dataset.seq_len", ds.seq_len,
         f"no conversation of the {rows.total:,} in the train split has a token to train within seq_len+1 tokens "
         f"({rows.reasons()}); the longest is {longest:,} tokens: raise dataset.seq_len, shorten the prompts"
         + (", or set dataset.overlong=truncate" if rows.dropped else ""))


def source(ds: DictConfig) -> str:
    return f"{ds.path or ds.hub} ({ds.format}, train_on={ds.train_on})"


def store_root(ds: DictConfig) -> Path:
    return cache_entry(ds, "chat", (ds.format, ds.get("messages_column"), ds.train_on, ds.val_every,
                                    ds.get("max_docs"), ds.empty_replies))


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, Path]:
    """{split: its directory}, rendered into the cache where missing (ConfigError: bad rows)."""
    ds = cfg.dataset
    root = store_root(ds)
    if not _complete(root):
        _write(ds, root)
    return {s: root / s for s in SPLITS}


def _complete(root: Path) -> bool:
    from loom.data.store import SIDECAR

    return all((root / s / "tokens" / SIDECAR).is_file() for s in SPLITS)


def _empty_reply(messages: list[dict]) -> int | None:
    """The index of the first assistant message with an empty reply (no text, no tool call)."""
    return next((k for k, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")
                 and not str(m.get("content") or "").strip()), None)


def _write(ds: DictConfig, root: Path) -> None:
    """Render every row into a directory beside `root`, renamed to it when whole (row i is
    validation when i % val_every == val_every-1); a failure removes it."""
    write_whole(root, _complete, lambda tmp: _render_rows(ds, tmp))


def _render_rows(ds: DictConfig, root: Path) -> None:
    render_splits(ds, root, SPLITS, _SplitWriter, _render_into)


def _render_into(ds: DictConfig, out: dict[str, _SplitWriter], template: ChatTemplate, tokenizer: Any) -> int:
    """Every row into its split's writer; returns the rows dropped for an empty reply (ConfigError:
    rows that cannot be trained, or nothing to train)."""
    bad: list[str] = []
    n_bad = rows = empty = 0
    every = int(ds.val_every or 0)
    column = ds.get("messages_column") or "messages"
    log.info(f"dataset chat: rendering {ds.path or ds.hub} with {template.source} (once)")
    for i, row in source_rows(ds):
        rows += 1
        try:
            messages, tools = conversation(row, ds.format, column)
            k = _empty_reply(messages)
            if k is not None and ds.empty_replies == "drop":
                empty += 1
                continue
            if k is not None:
                raise RowError(f"message {k} (assistant) is empty: trained, it teaches an immediate end of turn "
                               "(dataset.empty_replies=drop drops such rows, counted)")
            rendered = render(template, tokenizer, messages, tools, ds.train_on)
        except (RowError, TemplateError) as e:
            n_bad += 1
            if len(bad) < SHOWN:
                bad.append(f"row {i}: {e}")
            continue
        out["val" if every > 1 and i % every == every - 1 else "train"].add(rendered)
    where = f"dataset.path={ds.path or ds.hub}"
    if n_bad:
        raise ConfigError(f"Invalid config: {where}: {n_bad:,} of {rows:,} rows cannot be trained (nothing was "
                          "written). " + "; ".join(bad) + ("; ..." if n_bad > len(bad) else ""))
    if out["train"].n == 0:
        gone = f" ({empty:,} with an empty assistant reply dropped)" if empty else ""
        raise ConfigError(f"Invalid config: {where}: no conversation to train on: {rows:,} rows{gone} (nothing "
                          "was written)" + ("; dataset.empty_replies=refuse names them" if empty else ""))
    return empty


class _SplitWriter:
    """The tokens and mask stores of one split and its conversations array."""

    def __init__(self, d: Path, spec: Any) -> None:
        import shutil

        from loom.data.store import ShardWriter

        shutil.rmtree(d, ignore_errors=True)
        self.d, self.spec = d, spec
        self.tokens = ShardWriter(d / "tokens" / "part-00000", spec.dtype)
        self.mask = ShardWriter(d / "mask" / "part-00000", np.uint8)
        self.rows: list[tuple[int, int, int]] = []
        self.offset = self.trained = 0

    @property
    def n(self) -> int:
        return len(self.rows)

    def abort(self) -> None:
        self.tokens.abort()
        self.mask.abort()

    def add(self, r: Any) -> None:
        self.tokens.add_document(r.ids)
        self.mask.add_document(r.mask)
        self.rows.append((self.offset, len(r.ids), r.trained))
        self.offset += len(r.ids)
        self.trained += r.trained

    def finish(self, ds: DictConfig, template: ChatTemplate, split: str, empty: int) -> None:
        from loom.atomic import atomic_path
        from loom.data.store import write_sidecar

        self.tokens.finish()
        self.mask.finish()
        with atomic_path(self.d / CONVERSATIONS) as tmp, open(tmp, "wb") as f:
            np.save(f, np.asarray(self.rows, dtype=np.int64).reshape(-1, 3))
        s = self.spec
        chat = {"train_on": ds.train_on, "template": template.source, "trained": self.trained,
                "masked": self.offset - self.trained, "conversations": self.n, "split": split,
                "dropped_empty_replies": empty}  # of the whole source (rows are dropped before the split)
        base = {"format": "loom-token-store", "version": 1, "shards": ["part-00000"], "documents": self.n,
                "tokens": self.offset, "sources": [{"path": str(ds.path or ds.hub)}], "chat": chat}
        write_sidecar(self.d / "mask", {**base, "tokenizer": None, "vocab_size": 2, "dtype": "uint8"})
        write_sidecar(self.d / "tokens", {**base, "tokenizer": s.name, "tokenizer_fingerprint": s.fingerprint,
                                          "vocab_size": s.vocab_size, "eos_id": s.eos_id, "dtype": s.dtype})


