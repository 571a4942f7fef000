"""Datasets as config groups (conf/dataset/): every option yields (train, val) map-style
datasets behind one LightningDataModule with resumable distributed sampling.

A wing of options, like loom.models: each option is one module or folder under `options/`
handing the registry (`registry.py`, one line per option) its `DatasetOption` (`option.py`);
below them lie what options share (`checks.py`, `cache.py`, `files.py`, `fingerprint.py`,
`tokenizer.py`) and the token machinery (`tokens.py`, `prepare/`, `store/`, `index/`, `mix.py`,
`sampler.py`), which names no option. This module asks the registry on everyone else's behalf.

This package's top level stays free of torch: the schemas, checks and the questions other
groups ask (`is_token_data`, `is_pairs`, `items_per_sample`, `data_vocab_size`, `data_features`) run in
the launcher before torch is imported.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.data.checks import check_common, normalize_tokenizer, tokenizer_vocab, val_problem
from loom.data.fingerprint import fingerprint_line
from loom.data.registry import DATASETS
from loom.errors import ConfigError
from loom.layout import ParallelLayout
from loom.packages import Need

SCHEMAS: dict[str, type] = {name: option.schema for name, option in DATASETS.items()}

# This group's rows of loom.packages' table: an option's own packages, and a tokenizer's (transformers
# loads it; `tokenizers`, which reads a tokenizer.json, comes with it).
NEEDS: tuple[Need, ...] = (
    *(Need(f"dataset={name}", lambda cfg, name=name: cfg.dataset.name == name, module, example=(f"dataset={name}",))
      for name, option in DATASETS.items() for module in option.packages),
    Need("dataset.tokenizer=<name or directory>", lambda cfg: bool(cfg.dataset.get("tokenizer")), "transformers",
         example=("dataset.tokenizer=/models/tokenizer",)),
)


def dataset_fingerprint(cfg: DictConfig) -> str | None:
    """One line for the run id: the files the dataset option reads (its registry entry's
    `inputs`) and its tokenizer's; None when the config alone fixes the data."""
    return fingerprint_line(DATASETS[cfg.dataset.name].inputs(cfg.dataset), cfg.dataset)


def is_token_data(ds: DictConfig) -> bool:
    return DATASETS[ds.name].tokens(ds)


def text_encoding(ds: DictConfig) -> str | None:
    """How the dataset's text became ids: its tokenizer (a path or cached name), "bytes" (a text
    front end with no tokenizer reads UTF-8 bytes), or None (its ids are not text)."""
    if ds.get("tokenizer"):
        return str(ds.tokenizer)
    return "bytes" if DATASETS[ds.name].tokenized else None


def is_pairs(ds: DictConfig) -> bool:
    """Its samples are preference pairs: (chosen, rejected) sequences of seq_len tokens each."""
    return DATASETS[ds.name].pairs


def rows_per_sample(ds: DictConfig) -> int:
    """Sequences the model runs per sample: 2 for a preference pair (chosen and rejected), else 1."""
    return 2 if is_pairs(ds) else 1


def items_per_sample(cfg: DictConfig) -> int:
    """What "tokens" counts per sample: seq_len for token data (2 x seq_len for a preference pair:
    the model processes both sequences), 1 for a classified sample."""
    if not is_token_data(cfg.dataset):
        return 1
    return int(cfg.dataset.seq_len) * rows_per_sample(cfg.dataset)


def pair_count(cfg: DictConfig) -> int | None:
    """Preference pairs in the train and validation splits, once rendered (the plan's reference cost);
    None: not pairs, or not rendered yet."""
    return DATASETS[cfg.dataset.name].pair_count(cfg)


def data_vocab_size(cfg: DictConfig) -> int | None:
    """The token ids the data can hold (None: not token data)."""
    ds = cfg.dataset
    if not is_token_data(ds):
        return None
    if DATASETS[ds.name].vocab is not None:
        return DATASETS[ds.name].vocab(ds)
    return tokenizer_vocab(str(ds.tokenizer)) if ds.get("tokenizer") else 256


def data_features(cfg: DictConfig) -> tuple[int, int] | None:
    """(input features, classes) of feature data (None: token data)."""
    return DATASETS[cfg.dataset.name].features(cfg.dataset)


def data_where(ds: DictConfig) -> str | None:
    """Where a run's data lives as its config says it, opening nothing (None: nothing to say or
    an option this Loom does not know)."""
    option = DATASETS.get(str(ds.get("name")))
    return option.where(ds) if option is not None else None


def chat_template_file(ds: DictConfig) -> str | None:
    """The chat template file the data was rendered with, over the tokenizer's own (None: none)."""
    option = DATASETS.get(str(ds.get("name")))
    return option.template_file(ds) if option is not None else None


def normalize(cfg: DictConfig) -> None:
    if DATASETS[cfg.dataset.name].tokenized:
        normalize_tokenizer(cfg.dataset)
    DATASETS[cfg.dataset.name].normalize(cfg)


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    check_common(cfg.dataset, DATASETS[cfg.dataset.name].packings)
    if DATASETS[cfg.dataset.name].tokenized and cfg.dataset.get("tokenizer"):
        data_vocab_size(cfg)
    DATASETS[cfg.dataset.name].check(cfg, layout)
    check_val_split(cfg, layout)


def val_size(cfg: DictConfig) -> int | None:
    """The validation split's samples (token windows for a corpus) where it is known without
    tokenizing (the option's registry entry); None where only the workers can tell."""
    return DATASETS[cfg.dataset.name].val_size(cfg.dataset)


def check_val_split(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Periodic validation (trainer.val_every_n_steps > 0) over a split that yields no batch is
    refused here when its size is known; the workers check the rest, and warn otherwise."""
    every = cfg.trainer.val_every_n_steps
    n = val_size(cfg) if every > 0 else None
    problem = val_problem(cfg, n, layout.dp) if n is not None else None
    if problem:
        raise ConfigError(
            f"Invalid config: trainer.val_every_n_steps={every} asks for validation, but {problem}. Add data, "
            "lower dataset.val_every (every Nth file/sample is validation) or dataset.batch_size, or set "
            "trainer.val_every_n_steps=0.")


def packing_note(cfg: DictConfig, attention_share: float) -> str | None:
    """What `dataset.packing=documents` saves, for the plan: the FLOP count (and MFU) charges
    causal attention over the whole window; within documents of mean length M < seq_len the mask
    computes about M / seq_len of it. `attention_share`: attention's part of the FLOPs per token."""
    ds = cfg.dataset
    if ds.get("packing") != "documents":
        return None
    mean = DATASETS[ds.name].mean_document(ds)
    head = (f"dataset.packing=documents: the FLOP count and MFU charge attention over the whole window of "
            f"{ds.seq_len} tokens ({100 * attention_share:.0f}% of the FLOPs per token)")
    if mean is None:
        return head + "; the mask computes less, by the documents' lengths (unknown before the corpus is prepared)."
    kept = min(1.0, mean / int(ds.seq_len))
    return (head + f"; with documents of {mean:,.0f} tokens on average the mask computes about {100 * kept:.0f}% "
            f"of it: ~{100 * (1 - kept) * attention_share:.0f}% of the counted FLOPs are skipped.")


def prepare_stores(cfg: DictConfig, workers: int | None = None) -> None:
    """Tokenize a text front end's corpus into its cached stores before the ranks start, with
    every core (`workers` None) and progress lines; a no-op when cached or not a front end."""
    make = DATASETS[cfg.dataset.name].stores
    if make is not None:
        make(cfg, workers)


def build_datamodule(cfg: DictConfig, layout: ParallelLayout, global_rank: int) -> Any:
    """The run's LightningDataModule, sharded by this rank's data-parallel index (imports torch)."""
    from loom.data.module import LoomDataModule

    return LoomDataModule(cfg, layout.dp_rank(global_rank), layout.dp)


def storage_stats() -> dict | None:
    """This rank's object-storage counters (its loader workers' reads included), or None where
    the run reads no remote store: summary.json `storage`, perf/storage_wait_ms."""
    from loom.data.store.remote.stats import in_use

    return in_use()
