"""Process lifetime on Linux: a signal when the parent dies (prctl PR_SET_PDEATHSIG).

Three processes of a run tie their lifetime to their parent's this way: the torchrun agent to
the launcher (loom.launch), the ranks' forkserver to the agent (loom.worker.preload) and each
rank to the forkserver (loom.worker.main). No torch here; elsewhere than Linux, nothing.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


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
