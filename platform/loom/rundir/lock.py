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

LOCK_NAME = ".lock"
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
    return (f"Run {run_id} is already running in {run_dir}: {who} holds {run_dir / LOCK_NAME}. "
            f"Follow its logs with `tail -f {run_dir / 'logs' / 'rank-0.log'}`; wait for it to finish,{stop} "
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
    path = Path(run_dir) / LOCK_NAME
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
