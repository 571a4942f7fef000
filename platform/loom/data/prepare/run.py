"""`prepare`: work units into a token store directory, in parallel, resumable, visible only
when complete.

While it runs, `<out>/.prepare/` holds the plan (units, tokenizer, options) and each finished
unit's counts; shards `part-{i:05d}` are written beside it. A rerun with the same plan skips the
finished shards; one with another plan is refused (its shards would not belong together). The
sidecar `loom.json` is written last, then `.prepare/` is removed: a store with a sidecar is whole.
Where the store goes is a `StoreOut`: this folder itself, or object storage with this folder as
its staging area (loom.data.prepare.upload.RemoteOut).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from loom.atomic import atomic_write_text
from loom.data.prepare.encoding import TokenSpec, token_spec
from loom.data.prepare.pieces import DEFAULT_MAX_DOC_MB
from loom.data.prepare.progress import Progress
from loom.data.prepare.units import sources_of
from loom.data.prepare.worker import done_path, index_record, run_unit, shard_name, single_threaded
from loom.data.prepare.workunit import InputUnit
from loom.data.store import PREPARE_DIR, SIDECAR, write_sidecar
from loom.data.store.sidecar import INDEX_SHA
from loom.errors import ConfigError

PLAN = "plan.json"
_WHAT = {"tokenizer": "--tokenizer", "tokenizer_fingerprint": "the tokenizer's vocabulary", "field": "--field",
         "strict": "--strict", "sources": "the inputs (files or their sizes)",
         "units": "the work units (--shard-mb)", "version": "the plan format"}


def check_out(out: Path) -> None:
    """Refuse an --out that is a file, a complete store, or a directory of something else."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"Invalid usage: --out {out} is a file; give a directory for the store.")
    if (out / SIDECAR).is_file():
        raise ConfigError(
            f"Invalid usage: --out {out} is already a complete token store ({SIDECAR} is there). Use another "
            f"--out, or delete {out} to prepare it again (`loom data inspect {out}` describes it).")
    if out.is_dir() and not (out / PREPARE_DIR).is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"Invalid usage: --out {out} is a directory that is neither empty nor an interrupted prepare: "
            "the store's shards would mix with what is there. Use a new or empty --out.")


def make_plan(units: list[InputUnit], spec: TokenSpec, strict: bool) -> dict[str, Any]:
    """Everything the shards depend on, as JSON (compared on resume)."""
    fields = sorted({u.field for u in units if u.field and u.kind != "files"})
    plan = {"version": 1, "tokenizer": spec.name, "tokenizer_fingerprint": spec.fingerprint,
            "field": fields[0] if len(fields) == 1 else (fields or None), "strict": strict,
            "sources": sources_of(units), "units": [asdict(u) for u in units]}
    return json.loads(json.dumps(plan))


def refuse_other_plan(out: Path | str, old: dict[str, Any], new: dict[str, Any]) -> ConfigError:
    diff = [k for k in _WHAT if old.get(k) != new.get(k)]
    said = []
    for k in diff[:3]:
        shown = (old.get(k), new.get(k)) if k in ("tokenizer", "field", "strict") else None
        said.append(_WHAT[k] + (f" (was {shown[0]!r}, now {shown[1]!r})" if shown else ""))
    return ConfigError(
        f"Invalid usage: --out {out} holds an interrupted prepare of other work: {'; '.join(said)} differ. "
        f"Its finished shards cannot be mixed with this run's. Run the earlier command again to resume it, or "
        f"start over with a new --out or after deleting {out}.")


def open_plan(out: Path, plan: dict[str, Any]) -> None:
    """Start `.prepare/` with the plan, or check a resumed one's plan; drop stale temp files."""
    state = out / PREPARE_DIR
    f = state / PLAN
    if f.is_file():
        old = json.loads(f.read_text())
        if old != plan:
            raise refuse_other_plan(out, old, plan)
        for tmp in out.glob(".part-*.tmp"):  # a killed worker's half shard (ShardWriter's temp name)
            tmp.unlink(missing_ok=True)
        return
    state.mkdir(parents=True, exist_ok=True)
    atomic_write_text(f, json.dumps(plan, indent=1) + "\n")


def finished(out: Path, i: int) -> dict[str, Any] | None:
    """Unit i's counts when its shard is whole and its counts were saved; else None (redo it)."""
    done = done_path(out, PREPARE_DIR, i)
    prefix = out / shard_name(i)
    if not (done.is_file() and Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()):
        return None
    record = json.loads(done.read_text())
    if INDEX_SHA not in record:  # counted before done records kept the index's hash
        record.update(index_record(prefix))
    return record


class StoreOut:
    """Where a prepare's store goes: here, the folder it is tokenized into (`stage`). A subclass
    (upload.RemoteOut) sends each finished shard on and publishes the store elsewhere."""

    def __init__(self, stage: Path) -> None:
        self.stage = stage

    def check(self) -> None:
        """Refuse an output that is a complete store or something else (before any work)."""
        check_out(self.stage)

    def begin(self, plan: dict[str, Any]) -> None:
        open_plan(self.stage, plan)

    def kept(self, i: int, itemsize: int) -> dict[str, Any] | None:
        """Unit i's record when a previous run finished it (its shard is kept), else None."""
        return finished(self.stage, i)

    def unit_done(self, stats: dict[str, Any]) -> None:
        """Unit `stats["unit"]` has just finished (its shard and done record are in the stage)."""

    def publish(self, sidecar: dict[str, Any]) -> None:
        """The sidecar last, then the resume state goes: the store is whole from here on."""
        write_sidecar(self.stage, sidecar)
        shutil.rmtree(self.stage / PREPARE_DIR, ignore_errors=True)

    def discard(self) -> None:
        """Drop everything written (a refused store of nothing)."""
        shutil.rmtree(self.stage, ignore_errors=True)

    def kept_count(self, n: int) -> int | None:
        """How many of the n units are kept for a resume (None: cannot tell now)."""
        return sum(finished(self.stage, i) is not None for i in range(n))


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kill(ex: ProcessPoolExecutor) -> None:
    """Stop a pool's workers now (a refused unit need not wait for the others' units).
    Python 3.11 has no public call for it (3.14's terminate_workers)."""
    for p in list((getattr(ex, "_processes", None) or {}).values()):
        p.terminate()
    ex.shutdown(wait=False, cancel_futures=True)


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C held (blocked, not lost) while the pool starts its workers: a spawned process
    inherits the blocked signal, so a worker still importing when Ctrl-C comes does not print its
    own KeyboardInterrupt traceback (its initializer ignores SIGINT only after its imports, which
    under load took seconds); this process gets a Ctrl-C held meanwhile as soon as it is released."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _drain(queue: Any, on_report: Callable[[tuple], None]) -> None:
    """Pass on every progress report the workers have queued."""
    import queue as queue_module

    while True:
        try:
            on_report(queue.get_nowait())
        except (queue_module.Empty, OSError, EOFError):
            return


def run_units(tasks: list[tuple], workers: int, one_core: bool, on_done: Callable[[dict], None],
              on_report: Callable[[tuple], None] | None = None) -> None:
    """Run (i, unit, out, prepare_dir, spec, strict, max_doc_mb) tasks: in this process when one
    worker does (`one_core`: the tokenizer's threads off, so one worker is one core), else a spawn
    pool. `on_report` gets running units' progress about every second either way."""
    if workers <= 1:
        with _env(TOKENIZERS_PARALLELISM="false") if one_core else _env():
            for t in tasks:
                on_done(run_unit(*t, report=on_report))
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process whose tokenizer holds threads
    reports = ctx.Queue()
    with _sigint_held():  # the pool starts its workers as tasks are submitted
        ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=single_threaded, initargs=(reports,))
        pending = {ex.submit(run_unit, *t) for t in tasks}
    try:
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            _drain(reports, on_report or (lambda _: None))
            for fut in done:
                on_done(fut.result())
            if on_report is not None and not done:
                on_report(None)
    except BaseException:
        _kill(ex)
        raise
    ex.shutdown(wait=True)
    reports.close()


def refuse_tokenless(units: list[InputUnit], stats: list[dict[str, Any]], shown: int = 5) -> None:
    """An input with bytes that yields no token (binary, not UTF-8, or no text in its field) is exit 2
    naming it: a store of nothing trains nothing. Inputs are files (a file cut into several units
    adds up its units); a unit of several small files is judged whole. Empty files pass."""
    by_input: dict[tuple[str, ...], list[int]] = {}
    for u, st in zip(units, stats, strict=True):
        got = by_input.setdefault(u.paths if len(u.paths) > 1 else (u.paths[0],), [0, 0])
        got[0] += int(st["tokens"])
        got[1] += int(u.bytes)
    bad = [paths for paths, (tokens, size) in by_input.items() if tokens == 0 and size > 0]
    if not bad and sum(int(st["tokens"]) for st in stats):
        return
    named = "; ".join(" + ".join(paths) for paths in bad[:shown]) + ("; ..." if len(bad) > shown else "")
    raise ConfigError(
        f"Invalid input: {len(bad) or len(by_input)} input(s) yield no token ({named or 'every input'}): binary, "
        "not UTF-8 (counted in not_utf8) or without text in the field read. Remove them, narrow the glob, or "
        "name the field (--field); nothing was written.")


def _summarized(sources: list[dict[str, Any]], most: int = 1000) -> list[dict[str, Any]]:
    """The sidecar's sources: every input up to `most`, then one entry for the rest (a corpus
    of a million files would make a sidecar every launch reads far too big)."""
    if len(sources) <= most:
        return sources
    rest = sources[most:]
    total = None if any(s["bytes"] is None for s in rest) else sum(s["bytes"] for s in rest)
    return [*sources[:most], {"path": f"... and {len(rest):,} more inputs", "bytes": total}]


def _sidecar(spec: TokenSpec, plan: dict[str, Any], stats: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(s[k] for s in stats) for k in ("tokens", "documents", "not_utf8", "empty_skipped")}
    return {"format": "loom-token-store", "version": 1, "shards": [shard_name(s["unit"]) for s in stats],
            "tokenizer": spec.name, "tokenizer_fingerprint": spec.fingerprint, "vocab_size": spec.vocab_size,
            "eos_id": spec.eos_id, "dtype": spec.dtype, "sources": _summarized(plan["sources"]), **total,
            "field": plan["field"], INDEX_SHA: {shard_name(s["unit"]): s[INDEX_SHA] for s in stats}}


def prepare(units: list[InputUnit], out: Path | StoreOut, tokenizer: str | None, *, workers: int | None = None,
            strict: bool = False, progress: str = "auto", log: Callable[[str], None] | None = None,
            max_doc_mb: float = DEFAULT_MAX_DOC_MB) -> dict:
    """Tokenize `units` into the store `out` (resuming an interrupted prepare of the same plan);
    returns the sidecar. progress: "auto" (a bar on a TTY, else lines via `log`), "bar",
    "lines" or "none". `max_doc_mb`: the longest document tokenized whole where no checked cut
    is found (loom.data.prepare.pieces); not in the plan, as it changes no token, only what is
    refused. ConfigError for bad input; nothing is visible as a store until the end. `out`: a
    folder, or a StoreOut (a store in object storage, upload.RemoteOut)."""
    target = out if isinstance(out, StoreOut) else StoreOut(Path(out).expanduser())
    out = target.stage
    target.check()
    spec = token_spec(tokenizer)
    plan = make_plan(units, spec, strict)
    target.begin(plan)
    stats: dict[int, dict[str, Any]] = {}
    prog = Progress(len(units), sum(u.bytes for u in units), progress, log)
    itemsize = np.dtype(spec.dtype).itemsize
    for i in range(len(units)):
        kept = target.kept(i, itemsize)
        if kept is not None:
            stats[i] = kept
            prog.add(kept, kept=True)

    def on_done(s: dict[str, Any]) -> None:
        stats[s["unit"]] = s
        prog.add(s)
        target.unit_done(s)

    def on_report(report: tuple | None) -> None:
        prog.partial(report) if report is not None else prog.tick()

    tasks = [(i, u, str(out), PREPARE_DIR, spec, strict, max_doc_mb) for i, u in enumerate(units) if i not in stats]
    n = (os.cpu_count() or 1) if workers is None else max(1, workers)
    try:
        run_units(tasks, min(n, len(tasks)), one_core=n == 1, on_done=on_done, on_report=on_report)
    finally:
        prog.close()
    ordered = [stats[i] for i in range(len(units))]
    try:
        refuse_tokenless(units, ordered)
    except ConfigError:  # its shards hold nothing worth resuming (a unit refused mid-way keeps the others')
        target.discard()
        raise
    sidecar = _sidecar(spec, plan, ordered)
    bad = next((s["first_not_utf8"] for s in ordered if s["first_not_utf8"]), None)
    if bad:
        (log or prog.log)(f"prepare: {sidecar['not_utf8']:,} document(s) not UTF-8 were skipped (the first: "
                          f"{bad}); --strict refuses them instead")
    target.publish(sidecar)
    return sidecar
