"""What the ranks' forkserver imports once per launch (`loom.worker.agent`), before it forks
the ranks: torch, Lightning (about 5 s of CPU here, most of it torchmetrics and torch._dynamo
that Lightning pulls in) and the worker's own modules. Each rank would otherwise import all of
it again, all ranks at once on the same cores.

Nothing here may start a thread or initialize CUDA: a process forked after either is broken
(a held lock, a CUDA context the child cannot use). `cuda_untouched` checks the second. And a
module that read the rank from the environment at import read the forkserver's, which has
none: `adopt_rank` gives each forked rank its own (Lightning's `rank_zero_only`, which would
otherwise let every rank start a wandb run before the strategy sets it).

The forkserver itself dies with the agent at once (`_die_with_agent`): its ranks' parent-death
signal follows it, and a forkserver left to notice the agent's end and shut its interpreter
down (seconds, with torch loaded) would let a lost node's ranks train on meanwhile.

Garbage collection, as the `gc.freeze` documentation advises for a parent that forks without
exec: the forkserver imports with the collector off (the ~450,000 objects these imports create
set off repeated full collections: 15% of the import time here) and freezes what it imported
before forking. A rank (`resume_collection`) turns the collector back on; its collections then
skip the frozen imports (the worker's first full collection, before training, took 0.7 s
per rank scanning them) and never write to their pages, which stay shared with the forkserver.
"""

from __future__ import annotations

import gc
import os
import sys

AGENT_PID_ENV = "LOOM_AGENT_PID"  # set by loom.worker.agent before it starts the forkserver


def _in_forkserver() -> bool:
    """Whether this process is the agent's forkserver (a direct child of the agent importing
    this), not a test or an in-process run importing it."""
    return os.environ.get(AGENT_PID_ENV) == str(os.getppid())


def _die_with_agent() -> None:
    """In the forkserver: SIGKILL when the agent dies; titled `loom[<run id>] forkserver`."""
    import signal

    from loom.process import RUN_ID_ENV, die_with_parent, set_title, title

    die_with_parent(signal.SIGKILL)
    set_title(title(os.environ.get(RUN_ID_ENV, "?"), "forkserver"), "loom-forkserver")


IN_FORKSERVER = _in_forkserver()
if IN_FORKSERVER:
    _die_with_agent()
    gc.disable()

import pytorch_lightning  # noqa: E402, F401
import torch  # noqa: E402

import loom.worker.checkpoint_saver  # noqa: E402, F401
import loom.worker.distributed  # noqa: E402, F401
import loom.worker.fit  # noqa: E402, F401
import loom.worker.gc_control  # noqa: E402, F401
from loom.data import position  # noqa: E402, F401
from loom.tracking import recorder  # noqa: E402, F401

if IN_FORKSERVER:
    gc.freeze()


def resume_collection() -> None:
    """In a forked rank: the collector back on (the frozen imports stay out of its scans)."""
    gc.enable()


def cuda_untouched() -> bool:
    """Whether this process can still fork ranks that use CUDA."""
    return not torch.cuda.is_initialized()


# Modules whose `rank_zero_only.rank` was set from RANK / LOCAL_RANK when they were imported.
_RANK_AT_IMPORT = {"lightning_utilities.core.rank_zero": "RANK", "lightning_fabric.utilities.rank_zero": "RANK",
                   "pytorch_lightning.utilities.rank_zero": "RANK", "torchmetrics.utilities.prints": "LOCAL_RANK"}


def adopt_rank() -> None:
    """In a forked rank, once torchrun's variables are in os.environ: what the preloaded modules
    took from the environment at import, taken again from this rank's."""
    for name, key in _RANK_AT_IMPORT.items():
        only = getattr(sys.modules.get(name), "rank_zero_only", None)
        if only is not None:
            only.rank = int(os.environ.get(key, 0))


def leave_agents_pipe() -> None:
    """In a forked rank: close this rank's copy of the agent's end of the forkserver's liveness
    pipe. multiprocessing hands every child that fd (so that it could use the same forkserver),
    but while a rank holds it the forkserver never sees the agent die: it outlives a killed
    agent, and so do its ranks, whose parent-death signal follows the forkserver. Closed, the
    forkserver exits with the agent and the ranks with it. (A rank that starts processes with
    the forkserver method itself gets a fresh forkserver: it never had this one's address.)"""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # not a forkserver's child (the agent itself holds the pipe it owns)
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None
