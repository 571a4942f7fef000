"""`custom_dataset` of Loom's shipped tasks: their JSONL read from this folder, whatever the working
directory (lm-eval's `dataset_kwargs.data_files` alone is resolved against the current directory).
lm-eval imports this file by path, for Loom and for `lm_eval --include_path <this folder>` alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def load(data_files: dict[str, str], **_metadata: Any) -> Any:
    """The DatasetDict of `data_files` (split -> file name in this folder), read offline."""
    import datasets

    return datasets.load_dataset("json", data_files={split: str(HERE / name) for split, name in data_files.items()})
