"""One launcher per run dir: an advisory lock on `<run>/.lock`, held for the run's whole launch.

Without it the same command started twice trains twice in one directory (duplicate metric
rows, two trackers, one shared rank log). The lock is a POSIX record lock (`fcntl.lockf`):
NFS implements it (NLM, NFSv4 byte-range locks), unlike BSD `flock` on older clients, and the
kernel drops it when the holder exits however it exits (an exception, Ctrl-C, kill -9), so it
never outlives its process on one host; on NFS the server drops a dead client's lock when the
client's lease expires (NFSv4: about 90 s). The file's content (pid, host, start time, command)
is only for the message a refused launch prints. A holder clears it when it releases the lock;
content found by the next holder therefore names a launcher that died without releasing it
(a stale record, reported and replaced).

Multi-node launches: every node runs the same command on the same run dir (`run.id`, shared
storage), possibly on one host (tests, `hardware.num_nodes=2` on one machine), so a per-host
lock file would not tell the nodes of one run from two runs. Instead a single-node launcher
takes the lock exclusively and each node of a multi-node launch takes it shared: two
single-node launches exclude each other, a single-node and a multi-node launch exclude each
other, and the nodes of one multi-node run (which the rendezvous joins into one job) coexist.

Caveats of POSIX locks, which this module respects: they belong to the process (closing any
descriptor of the file in that process releases them, so the file is opened once and kept),
and forked children (DataLoader workers) do not inherit them.

The launcher's lock alone would pass to a new launcher while ranks of the old one still train
(a launcher killed with -9: ranks that outlived it trained beside the new attempt). So every rank
process also holds `<run>/.ranks.lock`, shared, for its life (`rank_lock`), and a single-node
launcher, once it holds the run's lock, waits until it can take that one exclusively
(`wait_for_ranks`), naming the live ranks, and refuses (exit 2, their pids) if they outlive the
wait. A run dir never has two live attempts.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loom.errors import ConfigError
from loom.rundir.paths import RunDir

RANKS_WAIT_S = 60.0         # how long a launcher waits for an earlier launch's ranks to exit
# The file system cannot lock (e.g. Lustre mounted without -o flock): run unguarded, with a warning.
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _records(fd: int) -> list[dict[str, Any]]:
    """The holder records, read through `fd`: opening the file again and closing it would
    release this process's lock (a POSIX lock goes with any closed descriptor of the file)."""
    try:
        size = os.fstat(fd).st_size
        lines = os.pread(fd, size, 0).decode(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "pid" in rec:
            out.append(rec)
    return out


def _alive(rec: dict[str, Any]) -> bool:
    """Whether a record's process may still run (True for another host: it cannot be checked)."""
    if rec.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(rec["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


def describe(rec: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("started", 0)))
    return f"pid {rec.get('pid')} on host {rec.get('host')} (started {started})"


def refusal(run_dir: Path, run_id: str, holders: list[dict[str, Any]]) -> str:
    """The one paragraph a second launch of a running run prints (exit 2)."""
    live = [r for r in holders if _alive(r)] or holders
    who = ("launcher " + "; ".join(describe(r) for r in live)) if live else "another launcher"
    pids = " ".join(str(r["pid"]) for r in live if r.get("host") == socket.gethostname())
    stop = f" stop it with `kill -TERM {pids}` (it saves a checkpoint)," if pids else ""
    return (f"Run {run_id} is already running in {run_dir}: {who} holds {RunDir(run_dir).lock}. "
            f"Follow its logs with `tail -f {RunDir(run_dir).log(0)}`; wait for it to finish,{stop} "
            "or set run.id=<new id> to train a separate run.")


def _try(fd: int, exclusive: bool) -> bool:
    """Take the lock without waiting; False if another process holds it."""
    try:
        fcntl.lockf(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def _record(shared: bool) -> str:
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3),
           "mode": "shared" if shared else "exclusive", "argv": " ".join(sys.argv)[:500]}
    return json.dumps(rec) + "\n"


def _write(fd: int, text: str, truncate: bool) -> None:
    if truncate:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
    else:
        os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, text.encode())
    os.fsync(fd)


def _release(fd: int, shared: bool) -> None:
    """Clear the record (the last sharer of a multi-node launch, or the exclusive holder), unlock."""
    try:
        if not shared or _try(fd, exclusive=True):
            os.ftruncate(fd, 0)
    except OSError:
        pass
    finally:
        os.close(fd)  # closing the only descriptor releases the POSIX lock


@contextmanager
def run_lock(run_dir: Path, run_id: str, shared: bool = False) -> Iterator[None]:
    """Hold `<run_dir>/.lock` for the body (exclusive; `shared` for a node of a multi-node
    launch). A held lock raises ConfigError (exit 2) naming the holder and its log file."""
    path = RunDir(run_dir).lock
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        got = _try(fd, exclusive=not shared)
    except OSError as e:
        os.close(fd)
        if e.errno not in _UNSUPPORTED:
            raise
        print(f"warning: {path.parent} is on a file system without POSIX locks ({e.strerror}): "
              "nothing stops a second launch of this run from training in the same directory",
              file=sys.stderr)
        yield
        return
    if not got:
        holders = _records(fd)
        os.close(fd)
        raise ConfigError(refusal(Path(run_dir), run_id, holders))
    try:
        stale = [] if shared else _records(fd)  # sharers append; the last one out clears
        if stale:
            print(f"note: the previous launcher of this run ({describe(stale[-1])}) ended without "
                  "releasing its lock (killed?); the lock is free and taken over", file=sys.stderr)
        _write(fd, _record(shared), truncate=not shared)
    except BaseException:
        _release(fd, shared)
        raise
    try:
        yield
    finally:
        _release(fd, shared)


@contextmanager
def rank_lock(run_dir: Path, rank: int) -> Iterator[None]:
    """This rank process's shared hold of `<run>/.ranks.lock` for the body (its life: the kernel
    drops it when the process dies, however it dies), with a record naming it."""
    fd = os.open(RunDir(run_dir).ranks_lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH)  # blocks only while a launcher's momentary check holds it exclusively
    except OSError as e:
        os.close(fd)
        if e.errno not in _UNSUPPORTED:
            raise
        yield  # a file system without POSIX locks: the launcher's lock is then the only guard
        return
    try:
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "started": round(time.time(), 3)}
        _write(fd, json.dumps(rec) + "\n", truncate=False)
        yield
    finally:
        os.close(fd)


def wait_for_ranks(run_dir: Path, run_id: str, timeout: float = RANKS_WAIT_S) -> None:
    """Before a launcher trains the run: wait until no rank of an earlier launch lives (a launcher
    killed with -9 takes its ranks down within a second, through their parent-death signals; this
    is the guarantee), saying so while it waits; ConfigError (exit 2) naming them if they outlive
    `timeout`. Clears the dead ranks' records."""
    path = RunDir(run_dir).ranks_lock
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDWR)
    try:
        deadline, said = time.monotonic() + timeout, False
        while True:
            try:
                if _try(fd, exclusive=True):
                    os.ftruncate(fd, 0)
                    return  # closing the descriptor lets it go at once
            except OSError as e:
                if e.errno in _UNSUPPORTED:
                    return
                raise
            live = [r for r in _records(fd) if _alive(r)]
            who = "; ".join(f"rank {r.get('rank')} {describe(r)}" for r in live) or "ranks on another host"
            if time.monotonic() > deadline:
                pids = " ".join(str(r["pid"]) for r in live if r.get("host") == socket.gethostname())
                raise ConfigError(
                    f"Run {run_id} in {run_dir} still has ranks of an earlier launch training after {timeout:.0f} s: "
                    f"{who}. Two attempts would train in one directory; wait for them to exit"
                    + (f", or stop them with `kill {pids}`" if pids else "") + ", then run the same command again.")
            if not said:
                print(f"loom: waiting for the ranks of an earlier launch of run {run_id} to exit ({who})",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(0.2)
    finally:
        os.close(fd)
