"""What a dataset option tells the rest of Loom: each option's module or folder under
`loom.data.options` ends with one `OPTION = DatasetOption(...)` that the registry lists.

Everything outside an option's folder asks this object, never the option's name or its own
config keys: the launcher asks `tokens`, `vocab`, `features`, `val_size`, `check`, `stores`;
the run id asks `inputs`; the console `source`; `loom report` `where`; `loom generate`
`template_file`; the objectives and the token count `pairs`. The torch half is named by `datasets` ("module:function", imported in the worker
only, inside the option's folder). The option's name is its schema's `name` default (one owner).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from loom.data.fingerprint import DataInputs
from loom.layout import ParallelLayout
from loom.schema import no_check, nothing_to_fill


def always(value: bool) -> Callable[[DictConfig], bool]:
    """A `tokens` answer that does not depend on the config."""
    return lambda ds: value


def no_features(ds: DictConfig) -> None:
    return None


@dataclass(frozen=True)
class DatasetOption:
    schema: type
    datasets: str                          # "module:function" (cfg) -> (train, val); imports torch
    tokens: Callable[[DictConfig], bool]   # yields (tokens, next tokens) rather than (features, label)
    # what it reads outside its config (files, a stand-in note): part of the run id, so editing a
    # corpus file starts a new run or is refused on resume. Required: no file-based option forgets it
    inputs: Callable[[DictConfig], DataInputs]
    source: Callable[[DictConfig], str]    # where its data comes from, for the console's dataset line
    # its validation split's size where known before launch (None: only the workers can tell)
    val_size: Callable[[DictConfig], int | None] = lambda ds: None
    features: Callable[[DictConfig], tuple[int, int] | None] = no_features  # (inputs, classes)
    tokenized: bool = False                # text tokenized into the cache by `prepare_data`
    check: Callable[[DictConfig, ParallelLayout], None] = no_check
    normalize: Callable[[DictConfig], None] = nothing_to_fill
    # a text front end's token stores, prepared into the cache where missing (torch-free; the
    # launcher calls it with every core before the ranks start): (cfg, workers) -> {split: store}
    stores: Callable[[DictConfig, int | None], dict] | None = None
    # its mean document length in tokens where known before launch (the plan's packing note)
    mean_document: Callable[[DictConfig], float | None] = lambda ds: None
    # the token ids its data can hold, where the option knows better than its tokenizer (None: ask it)
    vocab: Callable[[DictConfig], int | None] | None = None
    packings: tuple[str, ...] = ("concat", "documents")  # dataset.packing's choices
    packages: tuple[str, ...] = ()         # optional packages it needs (import names, loom.packages.PACKAGES)
    # where its data lives as the config says it, without opening anything (a frozen run's config:
    # `loom report`'s dataset column); None: nothing to say
    where: Callable[[DictConfig], str | None] = lambda ds: None
    # the chat template file it renders with, over the tokenizer's own (`loom generate --chat`)
    template_file: Callable[[DictConfig], str | None] = lambda ds: None
    # yields preference pairs (loom.data.batch.Batch.pairs): a sample is a (chosen, rejected) pair of
    # sequences, (2, seq_len) tokens, that share a micro batch and a rank (objectives, the token count)
    pairs: bool = False
    # pairs in the train and validation splits once rendered, None before (the plan's reference cost)
    pair_count: Callable[[DictConfig], int | None] = lambda cfg: None

    @property
    def name(self) -> str:
        """`dataset=<name>`: its schema's `name` default (conf/dataset/<name>.yaml)."""
        return str(self.schema.name)
