"""`dataset=preference`: (prompt, chosen, rejected) pairs for preference tuning (DPO, IPO, SimPO,
reward models), rendered with the model's chat template as `dataset=chat` renders conversations.

`pairs.py` reads a row (TRL's layouts) and renders a pair; `fit.py` (torch-free) is the stated rule
for overlong pairs; `build.py` the front end (checks, every row rendered into a cached token store
before launch); `samples.py` (torch) one `Batch(pairs=True)` of (2, seq_len) per pair, so chosen and
rejected always share a micro batch and a rank. This module holds the schema and the `DatasetOption`.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.data.conversation.front import inputs, normalize_paths
from loom.data.option import DatasetOption, always
from loom.data.options.preference import build


@dataclass
class PreferenceDatasetConfig:
    name: str = "preference"
    batch_size: int = 4               # pairs per device micro batch (2 sequences each)
    seq_len: int = 512                # each side's tokens (prompt + completion)
    path: str | None = None           # JSON lines / parquet files (a glob works) or a save_to_disk dir
    hub: str | None = None            # or a hub dataset id (offline: from the local HF cache)
    config: str | None = None
    split: str = "train"
    online: bool = False
    tokenizer: str | None = None      # required: the model's tokenizer (its chat template and ids)
    chat_template: str | None = None  # a Jinja file; null: the tokenizer's own
    prompt_column: str = "prompt"     # absent from a row: chosen/rejected are whole conversations, split
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    overlong: str = "truncate"        # truncate (the prompt's start first) | drop: a side over seq_len + 1 tokens
    identical: str = "drop"           # drop (warned, counted) | refuse: rows whose chosen equals rejected
    val_every: int = 20               # every Nth pair goes to validation (0: none)
    max_docs: int | None = None       # only the first N rows
    cache_dir: str | None = None


OPTION = DatasetOption(PreferenceDatasetConfig, "loom.data.options.preference.samples:datasets", always(True),
                       inputs, build.source, tokenized=True, stores=build.stores,
                       check=build.check_preference, normalize=normalize_paths, packings=(),
                       packages=("transformers",),  # the chat template's renderer
                       where=lambda ds: ds.hub or ds.path, template_file=lambda ds: ds.get("chat_template") or None,
                       pairs=True, pair_count=build.pair_count)
