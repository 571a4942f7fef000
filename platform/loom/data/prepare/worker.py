"""One work unit into one shard, in a worker process or in-process.

A unit's documents are read in order, tokenized in batches with the tokenizers library's batch
encoder (a document longer than pieces.PIECE_CHARS alone, in checked pieces) and appended to
`part-{i:05d}`; the counts go to `.prepare/done/part-{i:05d}.json` after the shard is whole, so a
resume keeps exactly the shards whose counts are known. While a unit runs, its progress (input
read, documents, tokens) is reported about every second: a pool worker's to the queue it was
started with, an in-process unit's to the caller's function.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.data.prepare.encoding import DocEncoder, TokenSpec
from loom.data.prepare.pieces import DEFAULT_MAX_DOC_MB, PIECE_CHARS, Uncuttable
from loom.data.prepare.readers import Cursor, NotUtf8, unit_docs
from loom.data.prepare.workunit import InputUnit
from loom.data.store.sidecar import INDEX_SHA
from loom.errors import ConfigError

BATCH_DOCS = 1024
BATCH_CHARS = 4 << 20  # ~50 MB of tokenizer memory for a batch of ordinary documents
DONE = "done"
REPORT_S = 1.0
Report = Callable[[tuple[int, int, int, int]], None]  # (unit, input read, documents, tokens)
_encoders: dict[TokenSpec, DocEncoder] = {}  # one tokenizer per process, loaded on first use
_queue: Any = None  # a pool worker's progress queue, given at its start


def single_threaded(progress_queue: Any = None) -> None:
    """A pool worker's start: one core (the tokenizers library's Rust threads off, read when it first
    encodes, so this runs before any worker encodes), Ctrl-C left to the parent, which stops the
    pool and says what is kept (a worker's own KeyboardInterrupt traceback was 26-47 lines), and
    the queue its units report progress to."""
    import signal

    global _queue
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _queue = progress_queue


def shard_name(i: int) -> str:
    return f"part-{i:05d}"


def done_path(out: Path, prepare_dir: str, i: int) -> Path:
    return out / prepare_dir / DONE / f"{shard_name(i)}.json"


def index_record(prefix: Path) -> dict[str, Any]:
    """The shard's .idx size and SHA-256, kept in its done record: the sidecar lists the hashes
    (a remote reader checks the index it fetched against them) and a resume of an upload checks
    the remote .idx's size without reading it."""
    data = Path(f"{prefix}.idx").read_bytes()
    return {INDEX_SHA: hashlib.sha256(data).hexdigest(), "idx_bytes": len(data)}


def _encoder(spec: TokenSpec) -> DocEncoder:
    if spec not in _encoders:
        _encoders[spec] = DocEncoder(spec)
    return _encoders[spec]


def _refuse_not_utf8(bad: NotUtf8) -> ConfigError:
    return ConfigError(
        f"Invalid input (--strict): {bad.where} is not UTF-8 text. Fix or drop that input, or run without "
        "--strict to skip such documents (they are counted and reported). Shards finished so far are kept: "
        "the same command resumes.")


def _refuse_uncuttable(where: str, chars: int, why: Uncuttable, max_doc_mb: float) -> ConfigError:
    need = math.ceil(chars / 1e6)
    return ConfigError(
        f"Invalid input: the document {where} has {chars / 1e6:.1f} M characters and {why}; this tokenizer "
        f"would take it whole, which needs far more memory than the text (about 0.5 GB for 4 M characters, "
        f"growing faster than the text), above --max-doc-mb {max_doc_mb:g}. Drop or split that document, or allow "
        f"it with --max-doc-mb {need} on a machine with the memory. Shards finished so far are kept: the "
        "same command resumes.")


def _long_doc(enc: DocEncoder, doc: str, cur: Cursor, max_doc_mb: float) -> Any:
    try:
        return enc.encode_long(doc, int(max_doc_mb * 1e6))
    except Uncuttable as e:
        raise _refuse_uncuttable(cur.where, len(doc), e, max_doc_mb) from None


def run_unit(i: int, unit: InputUnit, out: str, prepare_dir: str, spec: TokenSpec, strict: bool,
             max_doc_mb: float = DEFAULT_MAX_DOC_MB, report: Report | None = None) -> dict[str, Any]:
    """Write shard i from `unit`; returns its counts (also saved for a resume)."""
    from loom.data.store import ShardWriter

    enc, cur = _encoder(spec), Cursor()
    report = report or (_queue.put if _queue is not None else None)
    stats: dict[str, Any] = {"unit": i, "documents": 0, "tokens": 0, "not_utf8": 0, "empty_skipped": 0,
                             "first_not_utf8": None, "bytes": unit.bytes}
    batch: list[str] = []
    chars, last = 0, time.monotonic()
    with ShardWriter(Path(out) / shard_name(i), spec.dtype) as writer:
        def flush() -> None:
            for arr in enc.encode(batch):
                writer.add_document(arr)
            batch.clear()

        for doc in unit_docs(unit, cur):
            if isinstance(doc, str) and len(doc) > PIECE_CHARS:
                flush()
                chars = 0
                writer.add_document(_long_doc(enc, doc, cur, max_doc_mb))
            elif isinstance(doc, str):
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
            if report is not None and time.monotonic() - last >= REPORT_S:
                last = time.monotonic()
                report((i, min(cur.done, unit.bytes), writer.n_docs + len(batch), writer.n_tokens))
        flush()
        stats["documents"], stats["tokens"] = writer.n_docs, writer.n_tokens
    stats.update(index_record(Path(out) / shard_name(i)))
    done = done_path(Path(out), prepare_dir, i)
    done.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(done, json.dumps(stats) + "\n")
    return stats
