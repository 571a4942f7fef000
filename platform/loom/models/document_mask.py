"""Attention that never crosses a document boundary (`dataset.packing=documents`), for GPT and Llama.

The data side yields `pos` (B, T) beside the tokens: each token's position in its own document,
0 at every document start (a window that starts mid-document starts at 0 too). A token's
document id is `cumsum(pos == 0)` along T, and a query attends to a key when the key is not
after it and both share a document. The network builds one mask per forward (`document_mask`)
and hands it to every layer, which calls `attend` instead of SDPA's `is_causal`:

- on CUDA a FlexAttention `BlockMask` and `flex_attention`, both under torch.compile (eager
  flex materializes the whole score matrix; compiled, fully masked blocks are skipped, so the
  mask costs next to nothing: open_lm #206 measured a slow one at a third of throughput);
- on CPU a dense (B, 1, T, T) boolean mask for SDPA: torch's FlexAttention has no backward on
  CPU (eager or compiled: "FlexAttention does not support backward on CPU", torch 2.13), and
  CPU runs are small enough for T x T booleans. `flex=True` forces FlexAttention (forward only
  on CPU), which the tests use to check both give the same attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

DocumentMask = BlockMask | torch.Tensor

_compiled: dict[str, Callable] = {}


def document_ids(pos: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> (B, T) document ids: a new id at every position 0."""
    return (pos == 0).cumsum(dim=1)


def document_mask(pos: torch.Tensor, flex: bool | None = None) -> DocumentMask:
    """The causal, same-document mask of a (B, T) position batch, built once per forward.
    `flex`: FlexAttention's BlockMask (default on CUDA) or a dense boolean SDPA mask (CPU)."""
    B, T = pos.shape
    docs = document_ids(pos)
    if not (pos.device.type != "cpu" if flex is None else flex):
        causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
        return (causal & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    make = _compiled_on(pos.device, "create_block_mask", create_block_mask)
    return make(same_document_causal, B, None, T, T, device=pos.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, T, D) under a `document_mask`; Hkv < Hq
    is grouped-query attention (each key/value head serves Hq / Hkv query heads, no copies).
    FlexAttention has no dropout: validation refuses model.dropout > 0 with packing=documents."""
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, BlockMask):
        flex = _compiled_on(q.device, "flex_attention", flex_attention)
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


def _compiled_on(device: torch.device, name: str, fn: Callable) -> Callable:
    """`fn` under torch.compile on an accelerator (FlexAttention's fused kernels), eager on
    CPU (where only its forward runs, for the tests' comparison); compiled once per process."""
    if device.type == "cpu":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn)
    return _compiled[name]
