"""A byte-level GPT you can read in one sitting (after nanoGPT and torchtitan).

One fused q/k/v projection (`attn.qkv`, one GEMM instead of three) under every strategy. Its
output rows are grouped by head, Megatron's layout: head 0's q, k, v rows, then head 1's, ...
(`qkv.weight` is (n_head, 3, head_dim, d_model) flattened to (3 d_model, d_model)). So a
tensor-parallel plan that splits `attn.qkv` column-wise (torch's ColwiseParallel: contiguous
row blocks) gives each rank whole heads of q, k and v, and the parameter names, final weights
and checkpoint keys are the same with and without tensor parallelism. Weights saved with
separate `attn.q/k/v` (Loom before the fused layout) still load: `_load_from_state_dict`
interleaves them. Untied embeddings so FSDP/TP shard the head and the embedding independently.
Shapes use -1 for the head count, so the same code runs on a TP rank's local heads. Its
pipeline split (`pipeline_split`, loom.models.pipeline_split): blocks by index, wte + wpe with
the first stage, ln_f + lm_head with the last. `forward(idx, pos)` with per-document positions
(`dataset.packing=documents`): wpe reads `pos` and attention stays inside each document
(loom.models.document_mask); pipelines never pass `pos` (validation refuses that pairing).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.context_parallel import context_attention, split_inputs
from loom.models.document_mask import DocumentMask, attend, document_mask
from loom.models.init import Rule
from loom.models.pipeline_split import PipelineSplit


def gpt_rule(n_layer: int) -> Rule:
    """GPT-2's init (normal 0.02, residual projections scaled by 1/sqrt(2L))."""

    def rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name.endswith("bias"):
            return "zeros", 0.0
        if ".ln_" in name or name.startswith("ln_"):
            return "ones", 0.0
        if name.endswith("proj.weight"):
            return "normal", 0.02 / math.sqrt(2 * n_layer)
        return "normal", 0.02

    return rule


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.context = None  # strategy.cp: this rank's ContextShard (loom.models.context_parallel)

    def forward(self, x: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads, 3, head_dim) -> q, k, v of (B, heads, T, head_dim): the last dim stays
        # contiguous, which the flash / cuDNN / memory-efficient SDPA kernels require.
        q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        p = self.dropout if self.training else 0.0
        if self.context is not None:  # x holds this rank's slice of the sequence
            y = context_attention(self, q, k, v, mask, p)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            y = attend(q, k, v, mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """Accept the separate `q`, `k`, `v` entries of older weights: interleave them by head."""
        for kind in ("weight", "bias"):
            parts = [f"{prefix}{n}.{kind}" for n in ("q", "k", "v")]
            if f"{prefix}qkv.{kind}" not in state_dict and all(p in state_dict for p in parts):
                state_dict[f"{prefix}qkv.{kind}"] = fuse_qkv(*(state_dict.pop(p) for p in parts),
                                                             head_dim=self.head_dim)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Separate q/k/v weights (d_out, ...) or biases (d_out,) -> the fused, head-grouped `qkv` one."""
    rest = q.shape[1:]
    return torch.stack([t.reshape(-1, head_dim, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def read_fused_qkv(name: str, keys: set[str], read: Callable[[str], torch.Tensor], rows: range | None = None,
                   *, head_dim: int) -> torch.Tensor | None:
    """`attn.qkv` of weights saved with separate `attn.q/k/v` (models.init.FileInit's `derive`;
    always the whole value: `rows` is left to FileInit)."""
    prefix, _, kind = name.rpartition(".qkv.")
    parts = [f"{prefix}.{n}.{kind}" for n in "qkv"]
    if prefix and all(p in keys for p in parts):
        return fuse_qkv(*(read(p) for p in parts), head_dim=head_dim)
    return None


def split_qkv(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: a fused `qkv` weight or bias -> (q, k, v), heads in order."""
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(-1, 3, head_dim, *rest).unbind(1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), mask))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    pipeline_split = PipelineSplit(layers="blocks", first=("wte", "wpe"), last=("ln_f", "lm_head"))

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        d_model: int,
        vocab_size: int,
        block_size: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.n_layer = n_layer
        self.context = None  # strategy.cp: forward keeps this rank's slice of each sequence
        w = self.lm_head.weight
        if not (w.is_meta or hasattr(w, "ds_id")):  # meta or ZeRO-3: the worker initializes (models.construct)
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2's init (`gpt_rule`), each parameter from its own generator seeded by `seed`
        (default: torch's current seed) and its name, as sharded runs do."""
        from loom.models.init import NamedInit, initialize

        seed = torch.initial_seed() if seed is None else seed
        initialize(self, NamedInit(seed, gpt_rule(self.n_layer)), self.lm_head.weight.device)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token + learned position embeddings (the first pipeline stage's step); `pos`: (B, T)
        positions inside each document, else 0..T-1 for every row (context-parallel: the positions
        of this rank's slice in the whole sequence, as a pipeline's first stage embeds it)."""
        if pos is None:
            T, cp = idx.shape[1], self.context
            pos = torch.arange(T, device=idx.device) if cp is None else cp.positions(T * cp.size, idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def layer_inputs(self, x: torch.Tensor) -> tuple:
        """What each block takes beside the hidden states: nothing."""
        return ()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the vocabulary projection (the last pipeline stage's step)."""
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); with `pos`, each packed document as if it were alone. Context-parallel
        (`context`): the logits of this rank's slice, at its positions in the whole sequence."""
        idx, local_pos, whole = split_inputs(self, idx, pos)
        x = self.embed(idx, local_pos)
        mask = None if whole is None else document_mask(whole)  # once per forward, for every block
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)
