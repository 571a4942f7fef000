"""A Loom store directory's sidecar (`loom.json`): the one owner of its name, and of the scratch
folder a running prepare keeps, so writers and readers agree on both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.data.store.errors import FIX, StoreError

SIDECAR = "loom.json"
PREPARE_DIR = ".prepare"
INDEX_SHA = "index_sha256"  # {shard prefix: SHA-256 of its .idx}: checked when a remote index is fetched


def read_sidecar(store_dir: Path | str) -> dict[str, Any] | None:
    """The sidecar's contents, or None where the directory has none (a store from another tool)."""
    path = Path(store_dir) / SIDECAR
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: the store's sidecar cannot be read ({e}): {FIX}.") from None
    return parse_sidecar(text, str(path))


def parse_sidecar(text: str, where: str) -> dict[str, Any]:
    """A sidecar's text as its JSON object; StoreError naming `where` for anything else."""
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreError(
            f"{where}: the store's sidecar cannot be read ({e}); `loom data prepare` writes it last and "
            f"whole: {FIX}.") from None
    if not isinstance(info, dict):
        raise StoreError(f"{where}: the sidecar holds a {type(info).__name__}, not a JSON object: {FIX}.")
    return info


def write_sidecar(store_dir: Path | str, info: dict[str, Any]) -> Path:
    """Write the sidecar whole (temp file, then rename): it marks the store complete."""
    Path(store_dir).mkdir(parents=True, exist_ok=True)
    return atomic_write_text(Path(store_dir) / SIDECAR, json.dumps(info, indent=2) + "\n")
