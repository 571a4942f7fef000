"""A Llama-family decoder you can read in one sitting (Llama 2/3, and Qwen2 with `qkv_bias`).

RMSNorm, a SwiGLU MLP, rotary position embeddings (with Llama-3.1's frequency scaling) and
grouped-query attention (`n_kv_heads` key/value heads, each serving n_head / n_kv_heads query
heads). Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`,
`model.norm.weight`, `lm_head.weight`), and so is the rotary convention: `rotate_half` turns
the first and second half of each head together, not Meta's interleaved pairs. So a
transformers checkpoint loads name for name, and Loom's final weights load in transformers;
nothing is permuted. Tied embeddings have no `lm_head` at all: the head reuses
`model.embed_tokens.weight`, as the checkpoints of tied models (Llama 3.2 1B/3B) store it.
Shapes use -1 for head counts, so the same code runs on a tensor-parallel rank's local query
and key/value heads (models.lit's plan: q/k/v/gate/up column-wise, o/down row-wise). Its
pipeline split (`pipeline_split`): layers by index, embed_tokens with the first stage, norm +
lm_head with the last, the rotary embedding (no state) on every stage. `forward(idx, pos)` with
per-document positions (`dataset.packing=documents`): rotary angles at `pos`, attention inside
each document (loom.models.document_mask); pipelines never pass `pos` (refused at validation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.context_parallel import context_attention, split_inputs
from loom.models.document_mask import DocumentMask, attend, document_mask
from loom.models.init import Rule
from loom.models.pipeline_split import PipelineSplit


def llama_rule(std: float = 0.02) -> Rule:
    """transformers' Llama init (`initializer_range` 0.02 for every matrix, embeddings included;
    zero biases; unit RMSNorm weights), so a from-scratch Loom Llama starts as
    `LlamaForCausalLM.from_config` would."""

    def rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name.endswith("bias"):
            return "zeros", 0.0
        if name.endswith("norm.weight"):
            return "ones", 0.0
        return "normal", std

    return rule


class RMSNorm(nn.Module):
    """Normalized in fp32, cast back before the weight multiplies: transformers' order, so
    bf16 runs round the same way as the reference implementation."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None, device=None) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2 of them). With Llama-3.1 scaling: long
    wavelengths (beyond original_max_position_embeddings / low_freq_factor) are divided by
    `factor`, short ones (below ... / high_freq_factor) kept, those between interpolated
    (transformers' `_compute_llama3_parameters`)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin per position, (T, head_dim), computed in fp32 at every forward. No buffer:
    a bf16-true run casts buffers to bf16, which would round the frequencies; recomputing
    head_dim / 2 of them per forward costs nothing next to a layer."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, dict(scaling) if scaling else None

    def forward(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = rope_frequencies(self.head_dim, self.theta, self.scaling, device)
        freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, 1, T, head_dim) at each row's own positions (B, T): the same fp32
        products as `forward` at those positions, so a document packed at offset k gets exactly
        the angles it gets alone."""
        inv = rope_frequencies(self.head_dim, self.theta, self.scaling, pos.device)
        freqs = pos.to(torch.float32)[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos, sin: (T, head_dim), or (B, 1, T, head_dim) per row."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_head * self.head_dim, d_model, bias=False)
        self.context = None  # strategy.cp: this rank's ContextShard (loom.models.context_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA inside SDPA: each key/value head serves n_head / n_kv_heads query heads, no copies
        if self.context is not None:  # x holds this rank's slice of the sequence
            y = context_attention(self, q, k, v, mask)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        else:
            y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, intermediate_size, bias=False)
        self.up_proj = nn.Linear(d_model, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm block: the sharding unit (FSDP) and activation-checkpointing unit."""

    def __init__(self, d_model: int, n_head: int, n_kv_heads: int, intermediate_size: int,
                 eps: float, qkv_bias: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, eps)
        self.self_attn = Attention(d_model, n_head, n_kv_heads, qkv_bias)
        self.post_attention_layernorm = RMSNorm(d_model, eps)
        self.mlp = MLP(d_model, intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """transformers' `LlamaModel`: what sits under the `model.` prefix of the names."""

    def __init__(self, vocab_size: int, d_model: int, layers: list[DecoderLayer], eps: float,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(d_model, eps)
        self.rotary_emb = rotary


class Llama(nn.Module):
    """transformers' `LlamaForCausalLM` (and `Qwen2ForCausalLM` with qkv_bias=True): token ids
    (B, T) -> logits (B, T, vocab_size)."""

    pipeline_split = PipelineSplit(layers="model.layers", first=("model.embed_tokens",),
                                   last=("model.norm", "lm_head"))

    def __init__(self, n_layer: int, n_head: int, n_kv_heads: int, d_model: int, intermediate_size: int,
                 vocab_size: int, block_size: int, rope_theta: float = 500000.0,
                 rope_scaling: dict | None = None, rms_norm_eps: float = 1e-5,
                 tie_embeddings: bool = False, qkv_bias: bool = False) -> None:
        super().__init__()
        self.block_size, self.n_layer = block_size, n_layer
        layers = [DecoderLayer(d_model, n_head, n_kv_heads, intermediate_size, rms_norm_eps, qkv_bias)
                  for _ in range(n_layer)]
        self.model = LlamaBody(vocab_size, d_model, layers, rms_norm_eps,
                               RotaryEmbedding(d_model // n_head, rope_theta, rope_scaling))
        self.lm_head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.context = None  # strategy.cp: forward keeps this rank's slice of each sequence
        w = self.model.embed_tokens.weight
        if not (w.is_meta or hasattr(w, "ds_id")):  # meta or ZeRO-3: the worker initializes (models.construct)
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """`llama_rule`, each parameter from its own generator seeded by `seed` (default:
        torch's current seed) and its name, as sharded runs do."""
        from loom.models.init import NamedInit, initialize

        seed = torch.initial_seed() if seed is None else seed
        initialize(self, NamedInit(seed, llama_rule()), self.model.embed_tokens.weight.device)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings (the first pipeline stage's step)."""
        return self.model.embed_tokens(idx)

    def layer_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin every layer takes, for x's length, device and dtype: computed
        on every pipeline stage from the activations it receives, so nothing else is sent
        (context-parallel: at this slice's positions in the whole sequence)."""
        cp = self.context
        if cp is None:
            return self.model.rotary_emb(x.shape[1], x.device, x.dtype)
        return self.model.rotary_emb.at(cp.positions(x.shape[1] * cp.size, x.device)[None], x.dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the vocabulary projection (the last stage's step; a tied head reads
        the embedding, which is why validation refuses a tied Llama across pipeline stages)."""
        x = self.model.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.model.embed_tokens.weight)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); with `pos`, each packed document as if it were alone. Context-parallel
        (`context`): the logits of this rank's slice, rotated at its positions in the whole sequence."""
        idx, local_pos, whole = split_inputs(self, idx, pos)
        x = self.embed(idx)
        if local_pos is None:
            cos, sin = self.layer_inputs(x)
        else:  # built once per forward, for every layer
            cos, sin = self.model.rotary_emb.at(local_pos, x.dtype)
        mask = None if whole is None else document_mask(whole)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.head(x)
