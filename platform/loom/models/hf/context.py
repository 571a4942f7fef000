"""Context parallelism for a transformers decoder (`model=hf_causal_lm`, `strategy.cp`, Ulysses).

transformers calls its attention through `AttentionInterface` by the name in
`config._attn_implementation`: Loom registers `loom_ulysses`, whose function runs
`loom.models.context_parallel.ulysses_attention` on the q, k, v the model's own attention projected
(its rotary applied at the `position_ids` Loom passes: this rank's positions in the whole sequence).
No mask function is registered under that name, so transformers builds no mask for the slice (it
would be the slice's own causal mask): attention is causal over the whole gathered sequence.
Refused at validation where the architecture's attention is more than causal SDPA: sliding windows,
logit soft-capping (torch-free: `context_problem`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.models.context_parallel import ContextShard, ulysses_attention

NAME = "loom_ulysses"


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
               ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, H, T/cp, D), k and v (B, Hkv, T/cp, D) in,
    (B, T/cp, H, D) out, like its `sdpa_attention_forward`."""
    cp: ContextShard = module.loom_context
    y = ulysses_attention(query, key, value, None, cp, dropout if module.training else 0.0, scale=scaling)
    return y.transpose(1, 2).contiguous(), None


def apply(model: nn.Module, cp: ContextShard) -> int:
    """Route the model's attention through `loom_ulysses` on this rank's `ContextShard`; returns how
    many attention modules (those transformers marks `is_causal`) it reaches."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    model.set_attn_implementation(NAME)
    layers = [m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config")]
    for m in layers:
        m.loom_context = cp
    return len(layers)


def logits(model: nn.Module, ids: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """The logits of this rank's slice of `ids` (B, T): its tokens at their positions in the whole sequence."""
    B, T = ids.shape
    pos = cp.positions(T, ids.device).expand(B, -1)
    return model(input_ids=cp.local(ids), position_ids=pos, use_cache=False).logits
