"""`loom data inspect PATH`: what a token store holds, from its index and sidecar (no scan)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.data.store import (
    PREPARE_DIR,
    SIDECAR,
    StorageSettings,
    StoreError,
    is_remote,
    open_store,
    read_sidecar,
)
from loom.errors import ConfigError


def _listed(items: list[str], most: int = 8) -> str:
    more = f", ... and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _sidecar_lines(sc: dict[str, Any]) -> list[str]:
    tok = sc.get("tokenizer") or "none (byte-level)"
    eos = sc.get("eos_id")
    lines = [f"  tokenizer: {tok} (fingerprint {sc.get('tokenizer_fingerprint')})",
             f"  vocab: {sc.get('vocab_size')}, EOS id: {'none' if eos is None else eos}, dtype: {sc.get('dtype')}"]
    if sc.get("field"):
        lines.append(f"  field: {sc['field']}")
    skipped = [f"{sc[k]:,} {w}" for k, w in (("empty_skipped", "empty"), ("not_utf8", "not UTF-8"))
               if sc.get(k)]
    if skipped:
        lines.append(f"  skipped documents: {', '.join(skipped)}")
    sources = sc.get("sources") or []
    shown = [f"{s.get('path')} ({s['bytes']:,} bytes)" if s.get("bytes") is not None else str(s.get("path"))
             for s in sources]
    lines.append(f"  sources ({len(sources)}): {_listed(shown, 5)}")
    return lines


def inspect_text(path: str | Path, storage: StorageSettings | None = None) -> str:
    """The lines `loom data inspect` prints; ConfigError for an interrupted prepare or no store.
    `path`: a local path or an object-store URL (`storage`: its endpoint; open_remote refuses an
    interrupted remote prepare as this refuses a local one)."""
    remote = is_remote(path)
    p = str(path) if remote else Path(path).expanduser()
    if not remote and p.is_dir() and (p / PREPARE_DIR).is_dir() and not (p / SIDECAR).is_file():
        raise ConfigError(
            f"Invalid usage: {p} is an interrupted `loom data prepare` ({PREPARE_DIR}/ but no {SIDECAR}): not a "
            "store yet. Run the same prepare command again to resume it (finished shards are kept), or delete "
            f"{p}.")
    try:
        store = open_store(p, storage=storage)
    except StoreError as e:
        raise ConfigError(f"Invalid usage: {e}") from None
    sc = store.sidecar if store.sidecar is not None else (read_sidecar(p) if not remote and p.is_dir() else None)
    lines = [store.describe()]
    if sc is None:
        lines.append("  no sidecar: written by another tool (e.g. Megatron's preprocess_data.py); the tokenizer "
                     "is not recorded, so a run cannot check it against its own")
    else:
        lines += _sidecar_lines(sc)
    tokens, docs = store.n_tokens, store.n_docs
    mean = f"{tokens / docs:,.1f} tokens" if docs else "n/a"
    lines.append(f"  tokens: {tokens:,}, documents: {'unknown' if docs is None else f'{docs:,}'}, "
                 f"mean document length: {mean}")
    names = [s.name for s in store.shards]
    lines.append(f"  shards ({len(names)}): {_listed(names)}")
    return "\n".join(lines)
