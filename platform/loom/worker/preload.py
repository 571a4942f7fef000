"""What the ranks' forkserver imports once per launch (`loom.worker.agent`), before it forks
the ranks: torch, Lightning (about 5 s of CPU here, most of it torchmetrics and torch._dynamo
that Lightning pulls in) and the worker's own modules. Each rank would otherwise import all of
it again, all ranks at once on the same cores.

Nothing here may start a thread or initialize CUDA: a process forked after either is broken
(a held lock, a CUDA context the child cannot use). `cuda_untouched` checks the second.
"""

from __future__ import annotations

import pytorch_lightning  # noqa: F401
import torch

import loom.worker.checkpoint_saver  # noqa: F401
import loom.worker.distributed  # noqa: F401
import loom.worker.fit  # noqa: F401
import loom.worker.gc_control  # noqa: F401
from loom.data import position  # noqa: F401
from loom.tracking import recorder  # noqa: F401


def cuda_untouched() -> bool:
    """Whether this process can still fork ranks that use CUDA."""
    return not torch.cuda.is_initialized()
