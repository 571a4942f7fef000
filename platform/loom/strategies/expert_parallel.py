"""Expert parallelism on the strategy's mesh (`strategy.ep`, a mixture of experts): the mesh with
an `ep` dim and the experts' FSDP2 over the ranks holding the same ones. Used by
`model_parallel` (fsdp, nd without tp or pp); the model splits its own experts
(`apply_expert_parallel`, loom.models.moe.module)."""

from __future__ import annotations

import logging
from typing import Any

from loom.layout import ParallelLayout

log = logging.getLogger("loom")


def shard_experts(module, mesh, lay: ParallelLayout, reshard_after_forward: bool, mp_policy: Any) -> None:
    """The module's experts split over the ep dim (its `apply_expert_parallel`: DTensors
    Shard(0) on that dim, tokens exchanged all-to-all), then FSDP2 over the ranks holding the
    same experts (the module scales the experts' gradients by 1 / ep: they sum every ep
    peer's tokens, and FSDP2 averages over dp / ep ranks)."""
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {"mesh": mesh["shard_mod_ep"], "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    experts = module.apply_expert_parallel(mesh["ep"])
    for sub in experts:
        fully_shard(sub, **kw)
    log.info(f"expert parallelism: {len(experts)} expert set(s) split over ep={lay.ep}, "
             f"sharded over {lay.dp_shard // lay.ep} rank(s) each")
