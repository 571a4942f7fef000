"""One registry of the dataset options: what each yields, how its sets are built, what it checks.

Adding a dataset = a yaml in conf/dataset/, a schema in `schema.py`, a module with
`datasets(cfg) -> (train, val)` (and, if it has fields to check, `check`/`normalize` in
`checks.py`), and one entry here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from loom.data import checks, hf, stores, text_files, tinycode
from loom.data.chat import build as chat
from loom.data.fingerprint import DataInputs, no_inputs
from loom.data.schema import (
    ChatDatasetConfig,
    DigitsDatasetConfig,
    HFDatasetConfig,
    SyntheticDatasetConfig,
    TextFilesDatasetConfig,
    TinycodeDatasetConfig,
    TokensDatasetConfig,
)
from loom.layout import ParallelLayout
from loom.schema import no_check, nothing_to_fill

DIGITS_FEATURES, DIGITS_CLASSES = 64, 10  # scikit-learn's 8x8 digits


def _always(value: bool) -> Callable[[DictConfig], bool]:
    return lambda ds: value


def _no_features(ds: DictConfig) -> None:
    return None


def _synthetic_features(ds: DictConfig) -> tuple[int, int] | None:
    return (math.prod(ds.shape), int(ds.num_classes)) if ds.kind == "tensors" else None


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
    features: Callable[[DictConfig], tuple[int, int] | None] = _no_features  # (inputs, classes)
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


DATASETS: dict[str, DatasetOption] = {
    "tokens": DatasetOption(TokensDatasetConfig, "loom.data.stores:datasets", _always(True), stores.inputs,
                            stores.source, val_size=stores.val_size, check=stores.check_tokens,
                            normalize=stores.normalize_tokens, vocab=stores.vocab,
                            mean_document=stores.mean_document),
    "tinycode": DatasetOption(TinycodeDatasetConfig, "loom.data.tinycode:datasets", _always(True),
                              tinycode.inputs, tinycode.source, tokenized=True, stores=tinycode.stores,
                              val_size=lambda ds: checks.corpus_val_size(ds, tinycode.corpus_files(ds.max_bytes))),
    "text_files": DatasetOption(TextFilesDatasetConfig, "loom.data.text_files:datasets", _always(True),
                                text_files.inputs, text_files.source, tokenized=True, stores=text_files.stores,
                                check=checks.check_text_files,
                                normalize=checks.normalize_text_files,
                                val_size=lambda ds: checks.corpus_val_size(
                                    ds, text_files.corpus_files(list(ds.paths), ds.max_bytes))),
    "hf": DatasetOption(HFDatasetConfig, "loom.data.hf:datasets", _always(True), hf.inputs, hf.source,
                        tokenized=True, stores=hf.stores, check=checks.check_hf, normalize=checks.normalize_hf,
                        packages=("datasets",)),
    "chat": DatasetOption(ChatDatasetConfig, "loom.data.chat.samples:datasets", _always(True), chat.inputs,
                          chat.source, tokenized=True, stores=chat.stores, check=chat.check_chat,
                          normalize=chat.normalize_chat, packings=chat.PACKINGS,
                          packages=("transformers",)),  # the chat template's renderer
    "digits": DatasetOption(DigitsDatasetConfig, "loom.data.digits:datasets", _always(False), no_inputs,
                            lambda ds: "scikit-learn's 8x8 digits", val_size=checks.digits_val_size,
                            features=lambda ds: (DIGITS_FEATURES, DIGITS_CLASSES), packages=("sklearn",)),
    "synthetic": DatasetOption(SyntheticDatasetConfig, "loom.data.synthetic:datasets",
                               lambda ds: ds.kind == "tokens", no_inputs, lambda ds: f"random {ds.kind}",
                               val_size=checks.synthetic_val_size, features=_synthetic_features,
                               check=checks.check_synthetic),
}
