"""Loom's GPT family (`model=gpt_*`), its torch-free half: schema, checks, parameter and FLOP
counts, the plan's parts and the state dict's shapes. The torch half: `network` (the GPT
itself, its init rule) and `module` (its LightningModule, TP plan and weight adapter)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from loom.errors import require
from loom.layout import ParallelLayout
from loom.models import checks
from loom.models.family import ModelFamily, Shapes
from loom.models.spec import ModelSpec, Parts

OPTIONS = ("gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b")  # one schema, several sizes
# its module class names (loom.models.gpt.network), named here because validation runs before
# torch is imported: the choices for strategy.shard_units
MODULE_CLASSES = ("Block", "CausalSelfAttention", "MLP", "Linear", "Embedding", "LayerNorm")


@dataclass
class GPTModelConfig:
    name: str = "gpt_tiny"
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256
    block_size: int = 256
    dropout: float = 0.0
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime
    vocab_used: int | None = None     # set by Loom: the tokenizer's ids below a padded vocab_size


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"must divide model.d_model={m.d_model}")
    checks.needs_tokens(cfg)
    checks.within_context(cfg, int(m.block_size), "model.block_size")
    checks.vocab_covers_data(cfg, m.vocab_size)


def parts(m: DictConfig) -> Parts:
    """The GPT under its TP plan (qkv and fc colwise, proj and mlp-out rowwise: their two biases
    and the two LayerNorms stay whole)."""
    d, V, T = int(m.d_model), int(m.vocab_size), int(m.block_size)
    # Korthikanti et al. 2022 eq. 2 without the attention scores (SDPA stores none): 10 s*b*h
    # bytes every TP rank repeats (two LayerNorm inputs, the q/k/v and MLP-up inputs, two dropout
    # masks) and 24 s*b*h split over them, in 16-bit; twice that in fp32.
    return Parts(per_layer=12 * d * d + 13 * d, per_layer_tp_whole=6 * d, first=V * d + T * d, last=V * d + 2 * d,
                 largest=max(4 * d * d, V * d, T * d), act_mixed=(10.0 * d, 24.0 * d), act_fp32=(20.0 * d, 48.0 * d),
                 act_autocast_extra=10.0 * d)


def spec(m: DictConfig, seq_len: int) -> ModelSpec:
    """Untied embeddings, biased linears, learned positions.

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


def shapes(m: DictConfig) -> Shapes:
    """The GPT's state_dict, from the config (a test checks it against the module)."""
    d, V, T = int(m.d_model), int(m.vocab_size), int(m.block_size)
    out: Shapes = {"wte.weight": (V, d), "wpe.weight": (T, d)}
    for i in range(int(m.n_layer)):
        b = f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{b}{ln}.weight"], out[f"{b}{ln}.bias"] = (d,), (d,)
        out |= {f"{b}attn.qkv.weight": (3 * d, d), f"{b}attn.qkv.bias": (3 * d,),
                f"{b}attn.proj.weight": (d, d), f"{b}attn.proj.bias": (d,),
                f"{b}mlp.fc.weight": (4 * d, d), f"{b}mlp.fc.bias": (4 * d,),
                f"{b}mlp.proj.weight": (d, 4 * d), f"{b}mlp.proj.bias": (d,)}
    return out | {"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (V, d)}


def separate_qkv(cfg: DictConfig, path: object, found: Shapes) -> list[str]:
    """model.init_from: older weights' separate attn.q/k/v count as the fused attn.qkv they load
    as (loom.models.gpt.network.read_fused_qkv)."""
    for k in [k for k in found if k.endswith(".attn.q.weight") or k.endswith(".attn.q.bias")]:
        prefix, kind = k.rsplit(".q.", 1)
        names = [f"{prefix}.{n}.{kind}" for n in "qkv"]
        if all(n in found for n in names) and f"{prefix}.qkv.{kind}" not in found:
            q = found[names[0]]
            for n in names:
                found.pop(n)
            found[f"{prefix}.qkv.{kind}"] = (3 * q[0], *q[1:])
    return []


FAMILY = ModelFamily(
    name="gpt_*", options=OPTIONS, schema=GPTModelConfig, check=check,
    spec=lambda cfg: spec(cfg.model, cfg.dataset.seq_len), build="loom.models.gpt.module:build",
    shapes=lambda cfg: shapes(cfg.model), normalize=checks.size_vocab_to_tokenizer,
    summary="Loom's byte-level GPT (fused q/k/v, learned positions), sized tiny to 7B",
    split_problem=lambda cfg, how: None, layers=lambda cfg: int(cfg.model.n_layer), width=lambda cfg: int(cfg.model.d_model),
    heads=lambda cfg: int(cfg.model.n_head), keys={"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_head"}, parts=lambda cfg: parts(cfg.model),
    largest=lambda cfg: float(parts(cfg.model).largest), document_masks=True, module_classes=MODULE_CLASSES,
    init_from_problems=separate_qkv, context_parallel=lambda cfg: None)
