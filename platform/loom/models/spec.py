"""Model arithmetic from config: parameter counts and training FLOPs per item.

`loom plan` answers before torch is imported, so for Loom's own models (GPT, Llama, MLP) the
counts are written out here; a test checks them against the real modules' `numel()`.
`hf_causal_lm` and `custom` models are counted by building them on the meta device (this
imports torch and the model's library, after validation); FLOPs of a custom model are
unknown (None: no TFLOP/s or MFU for it).

An "item" is what the run counts as tokens: a token for token data, a sample otherwise
(`items_per_sample`: dataset.seq_len, or 1 for a classified sample).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from loom.data import items_per_sample


@dataclass(frozen=True)
class ModelSpec:
    params: int | None           # all parameters (None: unknown)
    non_embedding_params: int | None
    flops_per_token: float | None  # training (forward + backward) per item; None: unknown
    n_layer: int
    d_model: int
    items_per_sample: int = 1    # tokens per sample (seq_len), 1 for classification
    matmul_params: int | None = None  # the N of 6N: weights multiplied per item (a tied head included)


@dataclass(frozen=True)
class Parts:
    """Where a layered decoder's parameters sit, for the plan's pipeline stages and tensor
    parallelism (torch-free): each layer's, the first stage's (embeddings), the last stage's
    (final norm and an untied head), what the model's TP plan leaves whole (norms, row-parallel
    biases, embeddings and head: Loom's plans split only the layers' projections), and the
    largest single parameter (materialized whole in fp32 before it is sharded)."""

    per_layer: int
    per_layer_tp_whole: int
    first: int
    last: int
    largest: int
    # Bytes one layer saves for backward per token: (every TP rank's, split over TP ranks), in
    # 16-bit mixed precision and in fp32; and what autocast adds on a pipeline rank (fp32 parts).
    act_mixed: tuple[float, float] = (0.0, 0.0)
    act_fp32: tuple[float, float] = (0.0, 0.0)
    act_autocast_extra: float = 0.0

    def layer_activation_bytes(self, tokens: int, tp: int, mixed: bool) -> float:
        """What one layer stores for backward for `tokens` tokens (seq x micro batch), per TP rank."""
        replicated, split = self.act_mixed if mixed else self.act_fp32
        return tokens * (replicated + split / tp)

    def tp_whole(self, layers: int, first: bool, last: bool) -> int:
        """Parameters a stage of `layers` layers keeps whole on every tensor-parallel rank."""
        return layers * self.per_layer_tp_whole + (self.first if first else 0) + (self.last if last else 0)


def gpt_parts(m: DictConfig) -> Parts:
    """loom.models.gpt under models.lit's TP plan (qkv and fc colwise, proj and mlp-out rowwise:
    their two biases and the two LayerNorms stay whole)."""
    d, V, T = int(m.d_model), int(m.vocab_size), int(m.block_size)
    # Korthikanti et al. 2022 eq. 2 without the attention scores (SDPA stores none): 10 s*b*h
    # bytes every TP rank repeats (two LayerNorm inputs, the q/k/v and MLP-up inputs, two dropout
    # masks) and 24 s*b*h split over them, in 16-bit; twice that in fp32.
    return Parts(per_layer=12 * d * d + 13 * d, per_layer_tp_whole=6 * d, first=V * d + T * d, last=V * d + 2 * d,
                 largest=max(4 * d * d, V * d, T * d), act_mixed=(10.0 * d, 24.0 * d), act_fp32=(20.0 * d, 48.0 * d),
                 act_autocast_extra=10.0 * d)


def llama_parts(m: DictConfig) -> Parts:
    """loom.models.llama under its TP plan (q/k/v/gate/up colwise, o/down rowwise, no bias on a
    row-parallel layer: only the two RMSNorm weights stay whole); no position table."""
    d, L, V, inner = int(m.d_model), int(m.n_layer), int(m.vocab_size), int(m.intermediate_size)
    q = int(m.n_head) * (d // int(m.n_head))
    head = 0 if m.tie_embeddings else V * d
    per_layer = (llama_spec(m, 1).params - V * d - d - head) // L
    kv = int(m.n_kv_heads) * (d // int(m.n_head))
    # Measured (saved-tensor hooks on loom.models.llama at h=512, varying kv and intermediate I),
    # bytes per token per layer: bf16 weights (FSDP2's policy, DeepSpeed) 20 h + 4 kv + 8 I;
    # under autocast over fp32 weights 10 h more (the fp32 residual stream into the norms); fp32
    # 32 h + 8 kv + 16 I. Every TP rank repeats RMSNorm's internals and the two matmul inputs;
    # q, the attention output and o_proj's input (6 h), k and v (4 kv) and SwiGLU's gate, up,
    # silu(gate) and product (8 I) are split over the TP ranks (twice the bytes in fp32).
    return Parts(per_layer=per_layer, per_layer_tp_whole=2 * d, first=V * d, last=d + head,
                 largest=max(inner * d, V * d, q * d), act_mixed=(14.0 * d, 6.0 * d + 4.0 * kv + 8.0 * inner),
                 act_fp32=(20.0 * d, 12.0 * d + 8.0 * kv + 16.0 * inner), act_autocast_extra=10.0 * d)


def gpt_spec(m: DictConfig, seq_len: int) -> ModelSpec:
    """The GPT of loom.models.gpt: untied embeddings, biased linears, learned positions.

    FLOPs per token: 6N (non-embedding) + 12*L*H*Q*T, PaLM appendix B; the lm_head matmul is
    counted in N here because, untied, it is a real matmul per token.
    """
    d, L, V, T = m.d_model, m.n_layer, m.vocab_size, m.block_size
    per_block = (
        2 * d            # ln_1 weight + bias
        + 3 * d * d + 3 * d  # qkv
        + d * d + d          # attention out projection
        + 2 * d              # ln_2
        + 4 * d * d + 4 * d  # mlp up
        + 4 * d * d + d      # mlp down
    )
    embeddings = V * d + T * d
    head = V * d
    final_ln = 2 * d
    total = embeddings + L * per_block + final_ln + head
    non_embedding = total - embeddings
    flops = 6 * non_embedding + 12 * L * d * seq_len
    return ModelSpec(total, non_embedding, float(flops), L, d, seq_len, non_embedding)


def gpt_spec_of(cfg: DictConfig) -> ModelSpec:
    return gpt_spec(cfg.model, cfg.dataset.seq_len)


def llama_spec(m: DictConfig, seq_len: int) -> ModelSpec:
    """loom.models.llama: GQA attention (n_kv_heads key/value heads), SwiGLU MLP (three
    d x intermediate matrices), two RMSNorm weights per layer and a final one, no positions
    (rotary), q/k/v biases when qkv_bias, and a head that is its own matrix unless tied.

    FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B: N the non-embedding parameters, H*Q =
    n_head * head_dim, T the sequence), with the head's V x d matmul counted in N even when it
    is tied to the embedding: a tied head holds no parameters but still multiplies per token.
    """
    d, L, V, inner = int(m.d_model), int(m.n_layer), int(m.vocab_size), int(m.intermediate_size)
    hd = d // int(m.n_head)
    q, kv = int(m.n_head) * hd, int(m.n_kv_heads) * hd
    attention = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if m.qkv_bias else 0)
    per_layer = attention + 3 * d * inner + 2 * d
    embedding = V * d
    head = V * d
    total = embedding + L * per_layer + d + (0 if m.tie_embeddings else head)
    non_embedding = total - embedding
    matmul = non_embedding + (head if m.tie_embeddings else 0)
    flops = 6 * matmul + 12 * L * q * seq_len
    return ModelSpec(total, non_embedding, float(flops), L, d, seq_len, matmul)


def llama_spec_of(cfg: DictConfig) -> ModelSpec:
    return llama_spec(cfg.model, cfg.dataset.seq_len)


def mlp_spec(cfg: DictConfig) -> ModelSpec:
    """loom.models.mlp: Linear layers in_features -> hidden... -> num_classes. FLOPs per sample:
    6 per weight (2 forward, 4 backward), the biases' adds neglected."""
    m = cfg.model
    widths = [int(m.in_features), *(int(h) for h in m.hidden), int(m.num_classes)]
    weights = sum(a * b for a, b in zip(widths, widths[1:], strict=False))
    params = weights + sum(widths[1:])
    return ModelSpec(params, params, float(6 * weights), len(widths) - 1, max(widths[1:-1] or widths[-1:]), 1)


def mlp_largest(cfg: DictConfig) -> float:
    """Elements of the MLP's widest weight."""
    m = cfg.model
    widths = [int(m.in_features), *(int(h) for h in m.hidden), int(m.num_classes)]
    return float(max(a * b for a, b in zip(widths, widths[1:], strict=False)))


def hf_largest(cfg: DictConfig) -> float:
    """A transformers decoder's largest parameter from its config: max(4*d*d, vocab*d)."""
    from loom.models.hf import config_dict

    c = config_dict(cfg.model)
    d = next((c[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(c.get(k), int)), 0)
    return float(max(4 * d * d, int(c.get("vocab_size") or 0) * d))


def hf_spec(cfg: DictConfig) -> ModelSpec:
    """A transformers decoder, counted from its meta-device build. FLOPs per token: 6N + 12 * Q * the
    sum over layers of the keys attended (seq_len, or a sliding window: hf.attention_spans), Q =
    heads x head_dim (Gemma's head_dim is not hidden_size / heads)."""
    from loom.models import hf

    T = items_per_sample(cfg)
    params, embedding, L, d, tied = hf.count(cfg.model)
    non_embedding = params - embedding
    head = hf.config_dict(cfg.model).get("vocab_size", 0) * d if tied else 0  # tied: a matmul, no params
    q, spans = hf.attention_spans(cfg.model, T)  # each layer's window where it has one (hf.attention_spans)
    flops = 6 * (non_embedding + head) + 12 * q * sum(spans) if L and d else None
    return ModelSpec(params, non_embedding, float(flops) if flops else None, L, d, T, non_embedding + head)


def custom_spec(cfg: DictConfig) -> ModelSpec:
    """Parameters of the user's module built on the meta device; None if that fails."""
    params = None
    try:
        import torch

        from loom.models.custom import instantiate

        with torch.device("meta"):
            module = instantiate(cfg.model.module)
        params = sum(p.numel() for p in module.parameters())
    except Exception:
        params = None
    return ModelSpec(params, params, None, 0, 0, items_per_sample(cfg))
