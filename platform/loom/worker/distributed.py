"""Process-group setup for ranks started by torchrun.

Initialized here, before Lightning (which then skips its own init), because torch's env://
rendezvous reuses the elastic agent's store across restarts without a per-attempt prefix:
after a restart a rank read the dead previous attempt's gloo address and failed to connect.
Prefixing the store with the restart count gives every attempt its own keys.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any


def init_options(backend: str, local_rank: int, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments of `init_process_group` beyond the store and ranks. On NCCL the group is
    bound to this rank's GPU (`device_id`): communicators are created eagerly for that device, and
    a rank never guesses its device from the current one (the "devices used by this process are
    currently unknown" barrier warning, and a hang when ranks guess differently)."""
    import torch

    opts: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if backend == "nccl":
        opts["device_id"] = torch.device("cuda", local_rank)
    return opts


def init_from_torchrun(backend: str, timeout_s: float = 600) -> bool:
    """Initialize the default process group from torchrun's environment; False if not under it.
    `timeout_s` is the init timeout (hardware.timeout_init_s); `set_train_timeout` shortens it."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "TORCHELASTIC_RUN_ID" not in os.environ or world == 1 or dist.is_initialized():
        return False
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=(rank == 0 and not agent_store), timeout=timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    # Multi-node runs (loom.launch) turn the agent's store sharing off: rank 0 then hosts a fresh
    # store every rendezvous round, and the restart count, which differs between nodes (a node
    # restarted because another failed keeps its count), must not be part of the keys.
    prefix = f"/loom/attempt_{attempt}" if agent_store else "/loom"
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
        **init_options(backend, local_rank, timeout_s),
    )
    return True


def set_train_timeout(timeout_s: float) -> int:
    """Shorten every process group's collective timeout once training runs (torchtitan's way:
    long for init, checkpoint loading and the first step's compilation, short afterwards). Every
    group this rank belongs to, not only the default one: a device mesh's and DeepSpeed's groups
    carry the collectives of the step. Returns how many groups were changed (0: no group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    changed = 0
    for group in list(c10d._world.pg_map):
        if group is not None and group != c10d.GroupMember.NON_GROUP_MEMBER:
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
            changed += 1
    return changed


def shutdown() -> None:
    """Wait for every rank, then tear the process group down. Without it a rank that finished
    first exited while rank 0 still wrote the final weights, and gloo's teardown aborted it
    ("terminate called without an active exception", exit -6) - a failed rank to torchrun."""
    import torch.distributed as dist

    # Only ranks torchrun started: an in-process run (one device) keeps its group, which the
    # next in-process run of a sweep (and DeepSpeed's cached groups) go on using.
    if "TORCHELASTIC_RUN_ID" in os.environ and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
