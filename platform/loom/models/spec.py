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
    layers: int                  # decoder layers (0: not a decoder)
    width: int                   # hidden size
    items_per_sample: int = 1    # tokens per sample (seq_len), 1 for classification
    matmul_params: int | None = None  # the N of 6N: weights multiplied per item (a tied head included)
    active_params: int | None = None  # what one token passes through (a mixture of experts: k of E); None: all


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
