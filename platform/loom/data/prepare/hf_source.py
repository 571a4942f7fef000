"""A Hugging Face `datasets` source, loaded offline unless asked: what `dataset=hf` tokenizes,
`dataset=chat` renders, and `loom data prepare`'s row-range workers reload by spec (readers.py).

Sources, one of:
- `dataset.hub=<id>` (+ `dataset.config`, `dataset.split`): a hub dataset. Offline by
  default (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1 are set for the run), so only the local
  HF cache is used; `dataset.online=true` lets the library download it.
- `dataset.path=<dir>`: a dataset saved with `save_to_disk` (a Dataset or a DatasetDict,
  whose `dataset.split` is used).
- `dataset.path=<file or glob>`: local .json/.jsonl/.csv/.txt/.parquet files.

Below the options and beside the prepare workers that reload it, so nothing imports it by name.
No torch here (the `datasets` library does not import it): validation reads a local source's
columns from its metadata or first record, and opens a hub dataset from the cache.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}


def set_offline(ds: DictConfig) -> None:
    """Offline unless `dataset.online=true` (then the user's environment decides)."""
    if not ds.get("online", False):
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        # The libraries read these at import: if this process imported them before, tell them.
        import sys

        if "huggingface_hub" in sys.modules:
            sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
        if "datasets" in sys.modules:
            sys.modules["datasets"].config.HF_HUB_OFFLINE = True
            sys.modules["datasets"].config.HF_DATASETS_OFFLINE = True


def is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file())


def data_files(path: str) -> list[Path]:
    from loom.data.files import expand

    p = Path(path).expanduser()
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    return expand(path)


def source_files(path: str) -> list[Path]:
    """A local source's files: every file of a directory (a save_to_disk dir's arrow files and
    metadata), else the data files the path or glob names."""
    p = Path(path).expanduser()
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else data_files(path)


def _saved_split_dir(p: Path, split: str) -> tuple[Path | None, list[str]]:
    """(the Dataset directory for `split`, the splits there are) of a save_to_disk dir."""
    if (p / "dataset_dict.json").is_file():
        splits = list(json.loads((p / "dataset_dict.json").read_text()).get("splits", []))
        return (p / split if split in splits else None), splits
    return p, []


def local_columns(path: str, split: str) -> tuple[list[str], int | None]:
    """(column names, rows if known) of a local source, from metadata or its first record.

    Raises ValueError with the reason when the source is unusable."""
    p = Path(path).expanduser()
    if is_saved_dataset(p):
        d, splits = _saved_split_dir(p, split)
        if d is None:
            raise ValueError(f"has no split {split!r}; its splits: {', '.join(splits)} (set dataset.split)")
        info = json.loads((d / "dataset_info.json").read_text()) if (d / "dataset_info.json").is_file() else {}
        cols = list((info.get("features") or {}).keys())
        state = json.loads((d / "state.json").read_text()) if (d / "state.json").is_file() else {}
        rows = None
        try:
            import pyarrow as pa

            rows = 0
            for f in state.get("_data_files", []):
                with pa.memory_map(str(d / f["filename"])) as src:
                    rows += pa.ipc.open_stream(src).read_all().num_rows
        except Exception:
            rows = None
        return cols, rows
    files = data_files(path)
    if not files:
        raise ValueError("matches no .json/.jsonl/.csv/.txt/.parquet file")
    kinds = {BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"mixes file types ({', '.join(sorted(kinds))}); point it at one type")
    kind, first = kinds.pop(), files[0]
    if all(f.stat().st_size == 0 for f in files):
        return ([], 0) if kind != "text" else (["text"], 0)
    if kind == "text":
        return ["text"], None
    if kind == "csv":
        with open(first, newline="") as fh:
            return next(csv.reader(fh), []), None
    if kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names), sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    with open(first) as fh:  # json: JSON lines, or one array of records
        line = fh.readline().strip()
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        rec = json.loads(first.read_text())
    if isinstance(rec, list):
        rec = rec[0] if rec else {}
    return (list(rec) if isinstance(rec, dict) else []), None


def column_is_text(path: str, split: str, column: str) -> bool | None:
    """Whether a local source's `column` holds strings (None: cannot tell without loading it).
    A list of chat messages would otherwise be tokenized as its Python repr."""
    p = Path(path).expanduser()
    if is_saved_dataset(p):
        d, _ = _saved_split_dir(p, split)
        info = d / "dataset_info.json" if d is not None else None
        if info is None or not info.is_file():
            return None
        feature = (json.loads(info.read_text()).get("features") or {}).get(column)
        return isinstance(feature, dict) and feature.get("dtype") in ("string", "large_string")
    files = data_files(path)
    if not files or files[0].suffix not in (".json", ".jsonl", ".parquet"):
        return None
    if files[0].suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        field = pq.read_schema(files[0]).field(column)
        return pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
    with open(files[0]) as fh:
        line = fh.readline().strip()
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return not isinstance(rec, dict) or isinstance(rec.get(column), str | type(None))


def load(ds: DictConfig) -> Any:
    """The `datasets.Dataset` of the configured split."""
    set_offline(ds)
    import datasets

    if ds.path:
        p = Path(ds.path).expanduser()
        if is_saved_dataset(p):
            loaded = datasets.load_from_disk(str(p))
            return loaded[ds.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        files = data_files(ds.path)
        # Local files' arrow conversion goes next to Loom's token cache when one is set.
        from loom.data.cache import cache_root

        cache = str(cache_root(ds.cache_dir) / "hf") if ds.cache_dir else None
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # its per-file bars on the console: Loom says what it reads
        try:
            return datasets.load_dataset(BUILDERS[files[0].suffix], data_files=[str(f) for f in files],
                                         split="train", cache_dir=cache)
        except Exception as e:  # a malformed file: one paragraph naming it and its row, not pyarrow's traceback
            from loom.data.bad_rows import unreadable

            raise unreadable("dataset.path", str(ds.path), files, e) from None
        finally:
            if bars:
                datasets.enable_progress_bars()
    return datasets.load_dataset(ds.hub, ds.config, split=ds.split)


def source_key(ds: DictConfig, dataset: Any | None, column: str | None = None) -> str:
    """What the token cache depends on: the local files, or the hub dataset's fingerprint (and
    the `column` read, where the caller reads one)."""
    from loom.data.cache import fingerprint

    spec = (ds.hub, ds.config, ds.split, column, ds.val_every, ds.get("max_docs"))
    if ds.path:
        return fingerprint(source_files(ds.path), *spec)
    return fingerprint([], *spec, getattr(dataset, "_fingerprint", None))


def docs(dataset: Any, column: str, val_every: int, want_val: bool, max_docs: int | None):
    """The texts of one split, one by one (document i is validation when i % val_every ==
    val_every - 1): the rule `loom.data.prepare.hf_row_units` applies by row range."""
    i = 0
    for batch in dataset.select_columns([column]).iter(batch_size=1000):
        for text in batch[column]:
            if max_docs is not None and i >= max_docs:
                return
            is_val = val_every > 1 and i % val_every == val_every - 1
            i += 1
            if text is not None and is_val == want_val:
                yield text if isinstance(text, str | bytes) else str(text)
