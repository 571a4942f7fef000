"""Model arithmetic from config alone (no torch): parameter counts and FLOPs per token.

`loom plan` answers before torch is imported, so the counts are written out here; a test
checks them against the real modules' `numel()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class ModelSpec:
    params: int              # all parameters
    non_embedding_params: int
    flops_per_token: float   # training (forward + backward)
    n_layer: int
    d_model: int


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
    return ModelSpec(total, non_embedding, float(flops), L, d)


def model_spec(cfg: DictConfig) -> ModelSpec:
    name = cfg.model.name
    if name.startswith("gpt"):
        return gpt_spec(cfg.model, cfg.dataset.seq_len)
    raise ValueError(f"no spec for model {name}")
