"""`dataset=chat`: conversations for supervised fine-tuning.

`loom.data.conversation` finds and renders the chat template (transformers' renderer, no torch) and
derives each token's trained flag by rendering prefix by prefix; `build.py` is the
front end (checks, rendering every row into cached token and mask stores before launch);
`samples.py` (torch) packs or pads them into samples whose loss is the global batch's token mean.
This module holds the schema and the `DatasetOption` the registry lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.data.conversation.front import inputs, normalize_paths
from loom.data.option import DatasetOption, always
from loom.data.options.chat import build


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


OPTION = DatasetOption(ChatDatasetConfig, "loom.data.options.chat.samples:datasets", always(True), inputs,
                       build.source, tokenized=True, stores=build.stores, check=build.check_chat,
                       normalize=normalize_paths, packings=build.PACKINGS,
                       packages=("transformers",),  # the chat template's renderer
                       where=lambda ds: ds.hub or ds.path, template_file=lambda ds: ds.get("chat_template") or None)
