"""`dataset=text_files`: your own text corpus, by glob patterns. `corpus.py` lists and sizes the
files and prepares their stores, `check.py` refuses what cannot train before any process starts;
this module holds the schema and the `DatasetOption` the registry lists. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.data.option import DatasetOption, always
from loom.data.options.text_files import check, corpus


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


OPTION = DatasetOption(TextFilesDatasetConfig, "loom.data.options.text_files.corpus:datasets", always(True),
                       corpus.inputs, corpus.source, tokenized=True, stores=corpus.stores, check=check.check,
                       normalize=check.normalize, val_size=check.val_size,
                       where=lambda ds: ", ".join(map(str, ds.paths)) or None)
