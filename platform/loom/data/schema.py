"""The schemas of the dataset options (conf/dataset/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TinycodeDatasetConfig:
    name: str = "tinycode"
    batch_size: int = 16
    seq_len: int = 128
    packing: str = "concat"           # concat | documents (no attention across documents)
    max_bytes: int = 16_000_000
    val_every: int = 20
    tokenizer: str | None = None      # null: byte-level (vocab 256); else a local HF tokenizer
    cache_dir: str | None = None


@dataclass
class TextFilesDatasetConfig:
    name: str = "text_files"
    batch_size: int = 16
    seq_len: int = 128
    packing: str = "concat"           # concat | documents (no attention across documents)
    paths: list[str] = field(default_factory=list)  # files or glob patterns (`**` recursive)
    max_bytes: int | None = None      # cap on the corpus size (first files in sorted order)
    val_every: int = 20               # every Nth file goes to validation (0: none)
    # fewer files than val_every: this fraction of the windows is validation (every
    # round(1/val_fraction)-th window; null: 1/val_every)
    val_fraction: float | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None


@dataclass
class HFDatasetConfig:
    name: str = "hf"
    batch_size: int = 16
    seq_len: int = 128
    packing: str = "concat"           # concat | documents (no attention across documents)
    hub: str | None = None            # a hub dataset id (offline: from the local HF cache)
    config: str | None = None         # the hub dataset's config name
    split: str = "train"
    path: str | None = None           # a save_to_disk dir or local json/csv/txt/parquet files
    text_column: str = "text"
    online: bool = False              # false: HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1
    val_every: int = 20               # every Nth document goes to validation (0: none)
    max_docs: int | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None


@dataclass
class TokensDatasetConfig:
    name: str = "tokens"
    batch_size: int = 16
    seq_len: int = 128
    # the sources: a store path each (a `loom data prepare` dir, a Megatron prefix, a nanoGPT .bin),
    # or {path, weight (default 1), name (default: the path's last part)}
    mix: list[Any] = field(default_factory=list)
    packing: str = "concat"           # concat | documents (no attention across documents)
    val_fraction: float | None = 0.005  # of each source's windows, held out (every k-th window)
    dtype: str | None = None          # a flat nanoGPT .bin's tokens: uint16 (default) | uint32
    tokenizer: str | None = None      # the run's tokenizer: checked against the stores' sidecars


@dataclass
class ChatDatasetConfig:
    name: str = "chat"
    batch_size: int = 4
    seq_len: int = 512
    path: str | None = None           # JSON lines / parquet files (a glob works) or a save_to_disk dir
    hub: str | None = None            # or a hub dataset id (offline: from the local HF cache)
    config: str | None = None
    split: str = "train"
    online: bool = False
    format: str = "messages"          # messages: a list of {role, content} | prompt_completion
    messages_column: str = "messages"
    tokenizer: str | None = None      # required: the model's tokenizer (its chat template and ids)
    chat_template: str | None = None  # a Jinja file; null: the tokenizer's own
    train_on: str = "assistant"       # assistant | all | last (the last assistant message)
    packing: str = "padded"           # padded: one conversation per row | documents: packed apart
    overlong: str = "truncate"        # truncate | drop: conversations longer than seq_len + 1 tokens
    empty_replies: str = "drop"       # drop | refuse: rows with an empty assistant reply (counted)
    val_every: int = 20               # every Nth conversation goes to validation (0: none)
    max_docs: int | None = None       # only the first N rows
    cache_dir: str | None = None


@dataclass
class DigitsDatasetConfig:
    name: str = "digits"
    batch_size: int = 32
    val_every: int = 5                # every Nth sample goes to validation (0: none)


@dataclass
class SyntheticDatasetConfig:
    name: str = "synthetic"
    batch_size: int = 16
    kind: str = "tokens"              # tokens | tensors
    seq_len: int = 128                # tokens
    vocab_size: int = 256             # tokens
    shape: list[int] = field(default_factory=lambda: [64])  # tensors: one sample's shape
    num_classes: int = 10             # tensors
    num_samples: int = 8192


SYNTHETIC_KINDS = ("tokens", "tensors")
