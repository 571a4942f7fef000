"""Context parallelism inside Loom's own attention (`strategy.cp`): each of cp ranks holds a slice of
every sequence of its micro batch.

The LightningModule hands the network the whole micro batch (every cp rank of a data-parallel rank
reads the same one); the network keeps its slice of the tokens (`ContextShard.local`), embeds them at
their positions in the whole sequence, and builds the causal or document mask from the whole
sequence's positions. Around attention:

- **Ulysses** (DeepSpeed-Ulysses, arXiv 2309.14509): q, k and v go from sequence-sharded
  (B, H, T/cp, D) to head-sharded (B, H/cp, T, D) by one all-to-all each, attention runs over the
  whole sequence (so a document mask is exactly the unsplit one), and the output returns by one more.
  funcol's `all_to_all_single_autograd` (its backward is the reverse exchange) runs on gloo and NCCL
  and traces under torch.compile. Written here because torch's `context_parallel` (ring over SDPA)
  has no CPU sharding rule for SDPA (LESSONS: Context parallelism), and Ulysses keeps every mask.
- **ring** (CUDA only, `cp_style=ring`): torch's module-wrapper context parallelism
  (`_ContextParallel` on the attention's `RingCore`): k and v pass around the ring; the slices are
  head-tail balanced (rank r holds chunks r and 2cp-1-r of 2cp, so causal work is even), the order
  torch's ring attention assumes with load balancing on. Plain causal only: validation refuses
  document packing under ring.

The loss (`local_loss`): each rank's share of the whole sequence's loss, so that FSDP2's mean over
dp_shard x cp ranks gives exactly the unsplit gradient, and the value logged is the whole loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

log = logging.getLogger("loom")


@dataclass
class ContextShard:
    """This rank's place among the cp ranks of its data-parallel rank, and their process group."""

    group: Any     # torch.distributed ProcessGroup of the cp ranks
    size: int
    rank: int
    style: str = "ulysses"  # ulysses | ring

    def chunks(self) -> list[int]:
        """Which of the sequence's equal chunks this rank holds, in order: one of cp (ulysses), or
        two of 2 cp, head and tail (ring's load balance)."""
        if self.style == "ring":
            return [self.rank, 2 * self.size - 1 - self.rank]
        return [self.rank]

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of `t` along its sequence dim `dim`."""
        pieces = self.size * (2 if self.style == "ring" else 1)
        n = t.shape[dim] // pieces
        parts = [t.narrow(dim, c * n, n) for c in self.chunks()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions in the whole sequence of this rank's tokens, (T/cp,)."""
        return self.local(torch.arange(length, device=device), dim=0)


def _seq_to_heads(x: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """(B, H, T/cp, D) sequence-sharded -> (B, H/cp, T, D) head-sharded: head block j goes to rank j,
    and the sequence chunks received from ranks 0 .. cp-1 line up in order."""
    B, H, Tl, D = x.shape
    n = cp.size
    send = x.reshape(B, n, H // n, Tl, D).transpose(0, 1).reshape(n, -1)
    recv = funcol.all_to_all_single_autograd(send, None, None, cp.group)
    return recv.view(n, B, H // n, Tl, D).permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Tl, D)


def _heads_to_seq(y: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """The inverse: (B, H/cp, T, D) -> (B, H, T/cp, D), head blocks back in rank order."""
    B, Hc, T, D = y.shape
    n = cp.size
    send = y.reshape(B, Hc, n, T // n, D).permute(2, 0, 1, 3, 4).reshape(n, -1)
    recv = funcol.all_to_all_single_autograd(send, None, None, cp.group)
    return recv.view(n, B, Hc, T // n, D).transpose(0, 1).reshape(B, n * Hc, T // n, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, cp: ContextShard,
                      dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Attention over the whole sequence of q (B, Hq, T/cp, D), k, v (B, Hkv, T/cp, D): causal
    when `mask` is None, else the whole sequence's document mask (loom.models.document_mask).
    Returns (B, Hq, T/cp, D). Hq and Hkv divide by cp (validation), so GQA groups stay whole."""
    from loom.models.document_mask import attend

    q, k, v = (_seq_to_heads(t, cp) for t in (q, k, v))
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
    else:
        y = attend(q, k, v, mask, dropout_p=dropout_p)
    return _heads_to_seq(y.contiguous(), cp)


class RingCore(nn.Module):
    """Causal SDPA as a module, so torch's ring context parallelism (`_ContextParallel`, CUDA) can
    wrap it: q, k, v arrive as this rank's head-tail slices and k, v travel the ring."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def context_attention(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """What an attention module of a context-parallel network calls instead of SDPA."""
    cp: ContextShard = module.context
    if cp.style == "ring":
        if k.shape[1] != q.shape[1]:  # the ring kernels take equal heads: each kv head repeated for its group
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return module.ring(q, k, v)
    return ulysses_attention(q, k, v, mask, cp, dropout_p)


def apply_context_parallel(network: nn.Module, mesh: Any, style: str) -> ContextShard:
    """Give the network and each of its attention modules (those with a `context` attribute) this
    rank's `ContextShard` on the mesh's cp dim; under ring, torch's ring attention on each `RingCore`."""
    group = mesh.get_group()
    cp = ContextShard(group, mesh.size(), mesh.get_local_rank(), style)
    for sub in network.modules():
        if hasattr(sub, "context"):
            sub.context = cp
            if style == "ring" and sub is not network:
                sub.ring = _ring_core(mesh)
    log.info(f"context parallelism: each sequence split over cp={cp.size} ranks ({style}), this rank's chunks "
             f"{cp.chunks()} of {cp.size * (2 if style == 'ring' else 1)}")
    return cp


def _ring_core(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    return parallelize_module(RingCore(), mesh, style)


def split_inputs(network: nn.Module, idx: torch.Tensor, pos: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(this rank's token ids, their positions in their documents or the sequence, the whole
    sequence's document positions for the mask) of a network's forward; without context
    parallelism (ids, pos, pos) unchanged, positions None meaning 0 .. T-1."""
    cp: ContextShard | None = getattr(network, "context", None)
    if cp is None:
        return idx, pos, pos
    local_pos = cp.local(pos) if pos is not None else cp.positions(idx.shape[1], idx.device).expand(idx.shape[0], -1)
    return cp.local(idx), local_pos, pos


def local_loss(logits: torch.Tensor, targets: torch.Tensor, cp: ContextShard, scale: torch.Tensor | None,
               used: int | None) -> torch.Tensor:
    """This rank's share of the whole sequences' loss: the summed cross-entropy of its slice over
    the whole micro batch's trained targets (every rank has them: no exchange), times cp, since FSDP2
    averages gradients over dp_shard x cp; the value is the whole loss (one scalar all-reduced)."""
    if used is not None and used < logits.shape[-1]:
        logits = logits[..., :used]
    mine = cp.local(targets)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), mine.reshape(-1), reduction="sum")
    per = 1.0 / (targets != -100).sum().clamp_min(1).to(total.dtype)  # this micro batch's token mean
    if scale is not None:  # chat: the global batch's token mean (NaN in validation: the batch's own)
        s = scale.reshape(-1)[0].to(total.dtype)
        per = torch.where(s.isnan(), per, s)
    return whole_of(total * per, cp)


def whole_of(share: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """A loss summed over the cp ranks' shares: its value the whole (one scalar all-reduced), its
    gradient cp x this rank's share's, since FSDP2 averages gradients over dp_shard x cp."""
    scaled = share * cp.size
    whole = funcol.all_reduce(share.detach(), "sum", cp.group)
    return scaled + (whole - scaled).detach()
