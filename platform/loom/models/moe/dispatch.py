"""Token dispatch for a mixture-of-experts layer: route each token's k expert choices to the experts,
run them, and combine the weighted results - on one rank, or with the experts split over ranks
(expert parallelism) and the tokens exchanged by all-to-all.

This is the torchtitan / Megatron-Core "token choice, dropless, all-to-all" pattern: every
(token, choice) copy is computed (no capacity factor, no dropped tokens), the copies are sorted by
expert so each expert sees one contiguous block (the layout a grouped GEMM such as
`torch._grouped_mm` takes, with `counts` giving the block sizes), and under expert parallelism the
blocks travel to the rank that holds their expert with an uneven all_to_all_single and come back
the same way. torch has no public MoE dispatch, so it is written here by hand.

The expert computation itself is the caller's `ffn(x_sorted, counts)`; this module only moves tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Ffn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""ffn(x_sorted [T, H], counts [E_local] int64: tokens per local expert in expert order, sum == T) -> [T, H]."""


def _fake(t: torch.Tensor) -> bool:
    """Whether `t` has no values (FakeTensorMode: `loom plan --rehearse` runs the step on shapes only)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _real():
    """A context where tensors are real even inside FakeTensorMode: the routing counts of a
    rehearsal are host values the step's shapes depend on."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Copies per expert [E]. A rehearsal's fake routing has no values, so it gets a perfectly
    balanced one (a real tensor; what the plan assumes too), the rows spread evenly over the experts."""
    if not _fake(flat):
        return torch.bincount(flat, minlength=num_experts)
    base, extra = divmod(flat.numel(), num_experts)
    with _real():
        return torch.tensor([base + (e < extra) for e in range(num_experts)], dtype=torch.int64)


def _sort_by_expert(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that sorts the N*k (token, choice) copies by expert (stable: within an expert the
    copies keep token order, so results are deterministic), and the copies per expert [E]."""
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, _counts(flat, num_experts)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i: `y[inv]` puts rows computed in `perm` order back in place."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _combine(y_sorted: torch.Tensor, order: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsort the copies' results, weight each by its routing weight and sum a token's k copies -> [N, H]."""
    n, k = top_w.shape
    y = y_sorted[_inverse(order)].view(n, k, y_sorted.shape[-1])  # not -1: n may be 0
    return (y * top_w.unsqueeze(-1)).sum(dim=1).to(dtype)


def dispatch_local(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int,
                   ffn: Ffn) -> torch.Tensor:
    """All experts on this rank. x [N, H]; top_idx [N, k] int64 chosen experts; top_w [N, k] their
    weights. Returns sum_k top_w * expert_{top_idx}(x), [N, H] in x.dtype; gradients reach x, top_w and
    the ffn's parameters (indexing and the weighted sum are differentiable)."""
    k = top_idx.shape[1]
    order, counts = _sort_by_expert(top_idx, num_experts)
    y_sorted = ffn(x[order // k], counts)
    return _combine(y_sorted, order, top_w, x.dtype)


def _regroup_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """Received rows come grouped by source rank, then local expert (each source sent its copies sorted
    by expert); the ffn wants one block per local expert. This stable permutation takes the rows to
    expert-major order (within an expert, by source rank). recv_counts: [ep, E_local]."""
    ep, e_local = recv_counts.shape
    expert_of_row = torch.arange(e_local, device=recv_counts.device).repeat(ep)
    return torch.argsort(torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1)), stable=True)


def dispatch_all_to_all(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, num_experts: int,
                        ffn: Ffn, group: dist.ProcessGroup) -> torch.Tensor:
    """Expert parallelism over `group` (size ep): rank r holds experts [r*E/ep, (r+1)*E/ep) and `ffn`
    computes only those. Same arguments and result as `dispatch_local`; every rank of the group must
    call it (with its own tokens, any N including 0). The copies go to their experts' ranks and back
    with uneven all_to_all_single; the token exchange has a backward (the reverse exchange)."""
    ep = dist.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size ep={ep}")
    e_local, k = num_experts // ep, top_idx.shape[1]
    order, counts = _sort_by_expert(top_idx, num_experts)
    # experts are contiguous per rank, so counts viewed [ep, E_local] is per (destination, local expert)
    if _fake(x):  # a rehearsal's balanced routing: every rank receives what it sends
        with _real():
            recv_counts = counts.clone().view(ep, e_local)
    else:
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # [ep * E_local]: per (source, local expert)
        recv_counts = recv_counts.view(ep, e_local)
    with _real() if _fake(x) else contextlib.nullcontext():
        send_splits = counts.view(ep, e_local).sum(dim=1).tolist()  # split sizes must be host ints
        recv_splits = recv_counts.sum(dim=1).tolist()
        regroup = _regroup_order(recv_counts)
        local_counts = recv_counts.sum(dim=0)
    x_recv = funcol.all_to_all_single_autograd(x[order // k], recv_splits, send_splits, group)
    y_recv = ffn(x_recv[regroup], local_counts)[_inverse(regroup)]
    y_sorted = funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)
    return _combine(y_sorted, order, top_w, x.dtype)


def expert_load(top_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, [E] int64 (a token counts once per choice): the moe/expert_load metric."""
    return _counts(top_idx.reshape(-1), num_experts)
