"""`dataset=hf`: text from the Hugging Face `datasets` library, offline unless asked: a hub
dataset from the local cache (`dataset.hub`), a save_to_disk directory or local
.json/.jsonl/.csv/.txt/.parquet files (`dataset.path`); loom.data.prepare.hf_source loads them.

No torch here: validation reads a local source's columns from its metadata or first record,
and opens a hub dataset from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from loom.data.checks import absolute
from loom.data.fingerprint import DataInputs
from loom.data.option import DatasetOption, always
from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout


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


def inputs(ds: DictConfig) -> DataInputs:
    """A local source's files; none for a hub dataset (the library's cache fingerprints it)."""
    from loom.data.prepare.hf_source import source_files

    return DataInputs(files=source_files(ds.path)) if ds.path else DataInputs()


def source(ds: DictConfig) -> str:
    return f"hub {ds.hub} ({ds.config or 'default'}, {ds.split})" if ds.hub else f"{ds.path}"


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, object]:
    """The train and val token stores, prepared into the cache where missing: row ranges of the
    dataset, which each prepare worker reloads from the `datasets` cache (document i is
    validation when i % val_every == val_every - 1). The dataset is loaded here only when a
    store is missing, or to fingerprint a hub dataset."""
    from omegaconf import OmegaConf

    from loom.data.prepare import hf_row_units
    from loom.data.prepare.hf_source import load, set_offline, source_key
    from loom.data.tokens import split_stores

    ds = cfg.dataset
    set_offline(ds)
    loaded: dict = {}

    def dataset():
        if "ds" not in loaded:
            loaded["ds"] = load(ds)
        return loaded["ds"]

    def units(want_val: bool):
        return lambda: hf_row_units(OmegaConf.to_container(ds), ds.text_column, dataset().num_rows,
                                    val_every=ds.val_every, want_val=want_val, max_docs=ds.get("max_docs"))

    key = source_key(ds, None if ds.path else dataset(), ds.text_column)
    return split_stores("hf", key, ds, {"train": units(False), "val": units(True)}, workers)


def datasets(cfg: DictConfig):
    """(train, val) token windows of the cached stores."""
    from loom.data.tokens import front_end_datasets

    return front_end_datasets(cfg, stores(cfg))


def normalize(cfg: DictConfig) -> None:
    if cfg.dataset.path:
        cfg.dataset.path = absolute(cfg.dataset.path)


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    ds = cfg.dataset
    if bool(ds.hub) == bool(ds.path):
        fail("dataset.hub" if ds.hub else "dataset.path", ds.hub or ds.path,
             "set exactly one of dataset.hub (a Hugging Face hub dataset id, e.g. dataset.hub=wikitext "
             "dataset.config=wikitext-2-raw-v1) and dataset.path (a save_to_disk directory or local "
             ".json/.jsonl/.csv/.txt/.parquet files)")
    columns, rows, where = _local(ds) if ds.path else _hub(ds)
    if ds.text_column not in columns:
        fail("dataset.text_column", ds.text_column,
             f"{where} has no such column; its columns: {', '.join(columns) or '(none)'}")
    if rows == 0:
        fail("dataset.path" if ds.path else "dataset.hub", ds.path or ds.hub, "the dataset is empty (0 rows)")
    if ds.path and _column_is_text(ds) is False:
        fail("dataset.text_column", ds.text_column, "holds lists or records, not text: it would be trained as "
             "their Python repr. Conversations (a list of {role, content}) train with dataset=chat (the chat "
             "template, assistant-only loss); otherwise name a text column")
    if ds.max_docs is not None and ds.max_docs < 1:
        fail("dataset.max_docs", ds.max_docs, "must be >= 1, or null for every document")


def _column_is_text(ds: DictConfig) -> bool | None:
    from loom.data.prepare.hf_source import column_is_text

    try:
        return column_is_text(ds.path, ds.split, ds.text_column)
    except (OSError, ValueError, KeyError):
        return None


def _local(ds: DictConfig) -> tuple[list[str], int | None, str]:
    from loom.data.prepare.hf_source import data_files, local_columns

    if not (Path(ds.path).exists() or data_files(ds.path)):
        fail("dataset.path", ds.path, "does not exist and matches no files")
    try:
        columns, rows = local_columns(ds.path, ds.split)
    except (ValueError, OSError) as e:
        fail("dataset.path", ds.path, str(e))
    return columns, rows, f"dataset.path={ds.path}"


def _hub(ds: DictConfig) -> tuple[list[str], int | None, str]:
    from loom.data.prepare.hf_source import set_offline

    set_offline(ds)
    try:
        import datasets

        data = datasets.load_dataset(ds.hub, ds.config, split=ds.split)
    except Exception as e:
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if not ds.online:
            raise ConfigError(
                f"Invalid config: dataset.hub={ds.hub!r} (config {ds.config!r}, split {ds.split!r}) is not "
                f"cached locally and Loom runs offline by default (HF_HUB_OFFLINE=1). Download it once "
                f"with dataset.online=true, or point dataset.path at a local copy. ({reason})"
            ) from None
        raise ConfigError(f"Invalid config: dataset.hub={ds.hub!r} could not be loaded: {reason}.") from None
    return list(data.column_names), data.num_rows, f"dataset.hub={ds.hub}"


OPTION = DatasetOption(HFDatasetConfig, "loom.data.options.hf:datasets", always(True), inputs, source,
                       tokenized=True, stores=stores, check=check, normalize=normalize, packages=("datasets",),
                       where=lambda ds: ds.hub or ds.path)
