"""MoE token dispatch (loom.models.moe.dispatch): the local dispatch against a per-token loop, and the
expert-parallel all-to-all dispatch on 2 and 4 spawned gloo ranks against the local one (float64,
outputs and gradients), each rank with its own, uneven batch and only its own experts' weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loom.models.moe.dispatch import dispatch_all_to_all, dispatch_local, expert_load

H, K, E_EP = 8, 2, 8  # hidden size, choices per token, experts in the expert-parallel tests


def make_ffn(w: torch.Tensor):
    """Expert e of the block is tanh(x @ w[e]), applied to the rows `counts` gives it."""
    def ffn(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        assert counts.dtype == torch.int64 and counts.shape == (w.shape[0],) and int(counts.sum()) == x.shape[0]
        parts = x.split(counts.tolist())
        return torch.cat([torch.tanh(p @ w[e]) for e, p in enumerate(parts)])
    return ffn


def naive(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """For each token, sum_k weight * expert(x): no sorting, no grouping."""
    rows = [sum(top_w[n, j] * torch.tanh(x[n] @ w[top_idx[n, j]]) for j in range(top_idx.shape[1]))
            for n in range(x.shape[0])]
    return torch.stack(rows)


def routing(n: int, num_experts: int, allowed: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K distinct experts per token drawn from `allowed`, and random positive weights."""
    scores = torch.rand(n, num_experts, generator=g, dtype=torch.float64)
    mask = torch.full((num_experts,), float("-inf"), dtype=torch.float64)
    mask[allowed] = 0.0
    top_idx = (scores + mask).topk(K, dim=1).indices
    top_w = torch.rand(n, K, generator=g, dtype=torch.float64) + 0.1
    return top_idx, top_w


def grads(out, g_out, *leaves):
    got = torch.autograd.grad(out, leaves, g_out, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, got, strict=True)]


def test_dispatch_local_matches_a_per_token_loop():
    n, e = 37, 6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    top_idx, top_w = routing(n, e, [0, 1, 2, 4, 5], g)  # expert 3 gets no token
    top_w.requires_grad_()
    w = torch.randn(e, H, H, generator=g, dtype=torch.float64, requires_grad=True)
    assert expert_load(top_idx, e)[3] == 0

    out = dispatch_local(x, top_idx, top_w, e, make_ffn(w))
    ref = naive(x, top_idx, top_w, w)
    assert out.shape == (n, H) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g_out = torch.randn(n, H, generator=g, dtype=torch.float64)
    for got, want in zip(grads(out, g_out, x, top_w, w), grads(ref, g_out, x, top_w, w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_expert_load_counts_each_choice():
    top_idx = torch.tensor([[0, 2], [2, 3], [0, 2]])
    load = expert_load(top_idx, 5)
    assert load.dtype == torch.int64
    assert load.tolist() == [2, 0, 3, 1, 0]


def test_experts_that_do_not_split_over_the_ranks_are_refused(fake_world_of_2):
    import torch.distributed as dist

    x, top_idx, top_w = torch.zeros(3, H), torch.zeros(3, K, dtype=torch.int64), torch.ones(3, K)
    with pytest.raises(ValueError, match=r"num_experts=5.*ep=2"):
        dispatch_all_to_all(x, top_idx, top_w, 5, make_ffn(torch.zeros(2, H, H)), dist.group.WORLD)


# --- expert parallelism on spawned gloo ranks ------------------------------------------------------------

def batch_of(rank: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens: 5 + 7 * rank of them (none on rank 2 of 4). Expert E-1 gets none; rank 0
    sends all its tokens to other ranks' experts; with ep 4 no token goes to rank 3's experts either."""
    e_local = E_EP // ep
    n = 0 if (ep == 4 and rank == 2) else 5 + 7 * rank
    banned = set(range(E_EP - e_local, E_EP)) if ep == 4 else {E_EP - 1}
    if rank == 0:
        banned |= set(range(e_local))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    top_idx, top_w = routing(n, E_EP, [e for e in range(E_EP) if e not in banned], g)
    return x, top_idx, top_w


def worker(rank: int, ep: int, init_file: str, out_dir: str) -> None:
    """One rank: the all-to-all dispatch with its local experts and the local dispatch with all of them, on
    the same tokens; (got, want) pairs to out_dir/<rank>.pt, or the traceback."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ep)
        e_local = E_EP // ep
        w_full = torch.randn(E_EP, H, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        w_mine = w_full[rank * e_local:(rank + 1) * e_local].clone().requires_grad_()
        w_full.requires_grad_()
        x, top_idx, top_w = batch_of(rank, ep)
        leaves = [x.requires_grad_(), top_w.requires_grad_()]
        g_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)

        out = dispatch_all_to_all(x, top_idx, top_w, E_EP, make_ffn(w_mine), dist.group.WORLD)
        dx, dw, dexp = grads(out, g_out, *leaves, w_mine)
        ref = dispatch_local(x, top_idx, top_w, E_EP, make_ffn(w_full))
        rx, rw, rexp = grads(ref, g_out, *leaves, w_full)
        dist.all_reduce(rexp)  # an expert's gradient sums over every rank's tokens
        load = expert_load(top_idx, E_EP)
        dist.all_reduce(load)
        result = {"out": (out, ref), "x.grad": (dx, rx), "top_w.grad": (dw, rw),
                  "expert.grad": (dexp, rexp[rank * e_local:(rank + 1) * e_local]), "load": load}
        dist.destroy_process_group()
    except BaseException:  # report instead of leaving the other ranks to time out silently
        import traceback

        torch.save({"traceback": traceback.format_exc()}, Path(out_dir) / f"{rank}.pt")
        os._exit(1)
    torch.save({k: tuple(t.detach() for t in v) if isinstance(v, tuple) else v for k, v in result.items()},
               Path(out_dir) / f"{rank}.pt")


def run_ranks(ep: int, tmp_path: Path) -> list[dict]:
    from conftest import spawn_ranks

    return spawn_ranks(worker, (ep, str(tmp_path / "init"), str(tmp_path)), ep, tmp_path)


def check_ranks(results: list[dict], ep: int) -> None:
    e_local = E_EP // ep
    load = results[0]["load"]
    assert load[-1] == 0 and load[:e_local].sum() > 0  # the routing covers what it means to
    if ep == 4:
        assert load[-e_local:].sum() == 0 and results[2]["out"][0].shape == (0, H)
    for rank, result in enumerate(results):
        for name in ("out", "x.grad", "top_w.grad", "expert.grad"):
            got, want = result[name]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")


def test_all_to_all_dispatch_on_2_ranks_matches_the_local_dispatch(tmp_path):
    check_ranks(run_ranks(2, tmp_path), 2)


def test_all_to_all_dispatch_on_4_ranks_matches_the_local_dispatch(tmp_path):
    check_ranks(run_ranks(4, tmp_path), 4)
