"""One work unit into one shard, in a worker process or in-process.

A unit's documents are read in order, tokenized in batches with the tokenizers library's batch
encoder and appended to `part-{i:05d}`; the counts go to `.prepare/done/part-{i:05d}.json` after
the shard is whole, so a resume keeps exactly the shards whose counts are known.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.data.prepare.encoding import DocEncoder, TokenSpec
from loom.data.prepare.readers import NotUtf8, unit_docs
from loom.data.prepare.workunit import InputUnit
from loom.errors import ConfigError

BATCH_DOCS = 1024
BATCH_CHARS = 4 << 20
DONE = "done"
_encoders: dict[TokenSpec, DocEncoder] = {}  # one tokenizer per process, loaded on first use


def single_threaded() -> None:
    """A pool worker's start: one core (the tokenizers library's Rust threads off, read when it first
    encodes, so this runs before any worker encodes), and Ctrl-C left to the parent, which stops the
    pool and says what is kept (a worker's own KeyboardInterrupt traceback was 26-47 lines)."""
    import signal

    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def shard_name(i: int) -> str:
    return f"part-{i:05d}"


def done_path(out: Path, prepare_dir: str, i: int) -> Path:
    return out / prepare_dir / DONE / f"{shard_name(i)}.json"


def _encoder(spec: TokenSpec) -> DocEncoder:
    if spec not in _encoders:
        _encoders[spec] = DocEncoder(spec)
    return _encoders[spec]


def _refuse_not_utf8(bad: NotUtf8) -> ConfigError:
    return ConfigError(
        f"Invalid input (--strict): {bad.where} is not UTF-8 text. Fix or drop that input, or run without "
        "--strict to skip such documents (they are counted and reported). Shards finished so far are kept: "
        "the same command resumes.")


def run_unit(i: int, unit: InputUnit, out: str, prepare_dir: str, spec: TokenSpec, strict: bool) -> dict[str, Any]:
    """Write shard i from `unit`; returns its counts (also saved for a resume)."""
    from loom.data.store import ShardWriter

    enc = _encoder(spec)
    stats: dict[str, Any] = {"unit": i, "documents": 0, "tokens": 0, "not_utf8": 0, "empty_skipped": 0,
                             "first_not_utf8": None, "bytes": unit.bytes}
    batch: list[str] = []
    chars = 0
    with ShardWriter(Path(out) / shard_name(i), spec.dtype) as writer:
        def flush() -> None:
            for arr in enc.encode(batch):
                writer.add_document(arr)
            batch.clear()

        for doc in unit_docs(unit):
            if isinstance(doc, str):
                batch.append(doc)
                chars += len(doc)
                if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                    flush()
                    chars = 0
            elif doc is None:
                stats["empty_skipped"] += 1
            else:
                if strict:
                    raise _refuse_not_utf8(doc)
                stats["not_utf8"] += 1
                stats["first_not_utf8"] = stats["first_not_utf8"] or doc.where
        flush()
        stats["documents"], stats["tokens"] = writer.n_docs, writer.n_tokens
    done = done_path(Path(out), prepare_dir, i)
    done.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(done, json.dumps(stats) + "\n")
    return stats


def run_unit_args(args: tuple) -> dict[str, Any]:
    """run_unit for a pool's map (one picklable tuple)."""
    return run_unit(*args)
