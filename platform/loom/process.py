"""Process lifetime on Linux: a signal when the parent dies (prctl PR_SET_PDEATHSIG); and the
titles that tell a run's processes apart.

Three processes of a run tie their lifetime to their parent's this way: the torchrun agent to
the launcher (loom.launch), the ranks' forkserver to the agent (loom.worker.preload) and each
rank to the forkserver (loom.worker.main). No torch here; elsewhere than Linux, nothing.

Titles: every rank is forked from the forkserver, so its command line would be the forkserver's
(`python -B -c from multiprocessing.forkserver import main ...`) in ps, top and nvidia-smi.
Each process shows `loom[<run id>] <role>` instead (launcher, agent, forkserver, rank R/W),
which `pgrep -f` finds, and keeps a short `comm` name (loom-rank-N, loom-agent, ...).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
RUN_ID_ENV = "LOOM_RUN_ID"  # the agent hands its run id to the forkserver's title (loom.worker.preload)


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6", use_errno=True)


def die_with_parent(death: signal.Signals) -> None:
    """Get `death` when the parent dies, and now if it already has (we were reparented)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(PR_SET_PDEATHSIG, death)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os.kill(os.getpid(), death)


def set_process_name(name: str) -> None:
    """The name `ps -o comm`, top and pgrep show (15 bytes at most)."""
    if sys.platform.startswith("linux"):
        import ctypes

        _libc().prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def title(run_id: str, role: str) -> str:
    """A Loom process's title: `loom[8ffef07017] rank 1/2`, `loom[8ffef07017] agent`."""
    return f"loom[{run_id}] {role}"


def set_title(text: str, comm: str | None = None) -> None:
    """`text` as this process's command line (/proc/<pid>/cmdline: ps, top, nvidia-smi,
    `pgrep -f`), written over argv's memory by setproctitle (a core dependency; without it,
    only `comm` changes). setproctitle also sets the comm name to the title's first 15 bytes:
    `comm` replaces it."""
    try:
        import setproctitle
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        setproctitle.setproctitle(text)
    if comm:
        set_process_name(comm)


@contextmanager
def titled(text: str, comm: str | None = None) -> Iterator[None]:
    """`set_title` for a while: the launcher of an in-process sweep runs several runs in turn."""
    name = _comm()  # first: setproctitle's first call renames comm
    try:
        import setproctitle

        before = setproctitle.getproctitle()
    except ImportError:
        before = None
    set_title(text, comm)
    try:
        yield
    finally:
        if before is not None:
            set_title(before, name)


def _comm() -> str | None:
    try:
        return Path("/proc/self/comm").read_text().strip() or None
    except OSError:
        return None
