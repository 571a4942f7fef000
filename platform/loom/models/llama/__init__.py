"""The Llama family (`model=llama*`: Llama 2/3, Qwen2, Mistral without a window), its torch-free
half: schema, checks, parameter and FLOP counts, the plan's parts, the state dict's shapes and
LoRA targets, and the Hugging Face config it reads and writes (`hf_config`). The torch half:
`network` (the decoder, its init rule) and `module` (its LightningModule and TP plan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import require
from loom.layout import ParallelLayout
from loom.models import checks
from loom.models.family import ModelFamily, Shapes, Targets
from loom.models.init_from import mismatches, source_file
from loom.models.llama import hf_config
from loom.models.schema import LoraConfig
from loom.models.spec import ModelSpec, Parts

# sized options, and `llama` whose sizes come from model.init_from's config.json
OPTIONS = ("llama_tiny", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b", "llama")
SIZED = tuple(o for o in OPTIONS if o != "llama")
TOKENIZER_SIZED = ("llama_tiny",)  # Loom's byte-level vocabulary, which a dataset.tokenizer replaces
FIELDS = ("n_layer", "n_head", "n_kv_heads", "d_model", "intermediate_size", "vocab_size", "block_size",
          "rope_theta", "rms_norm_eps", "tie_embeddings", "qkv_bias")


@dataclass
class LlamaModelConfig:
    """loom.models.llama.network (conf/model/llama*.yaml). A null field is filled from the
    config.json of the Hugging Face directory `init_from` names (`model=llama`: every shape)."""

    name: str = "llama_tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_kv_heads: int | None = None     # key/value heads (GQA); = n_head: multi-head attention
    d_model: int | None = None
    intermediate_size: int | None = None  # the SwiGLU MLP's width (gate/up rows)
    vocab_size: int | None = None
    block_size: int | None = None     # longest sequence (config.json max_position_embeddings)
    rope_theta: float | None = None
    # Llama-3.1 frequency scaling {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; null: plain rotary
    rope_scaling: dict[str, float] | None = None
    rms_norm_eps: float | None = None
    tie_embeddings: bool | None = None  # the head reuses model.embed_tokens.weight (no lm_head.weight)
    qkv_bias: bool | None = None      # biases on q/k/v_proj (Qwen2)
    init_from: str | None = None      # a run dir, a .safetensors file, or a Hugging Face dir
    init_from_fingerprint: str | None = None  # set by Loom: the files' sizes and mtimes
    vocab_used: int | None = None     # set by Loom: the tokenizer's ids below a padded vocab_size
    lora: LoraConfig = field(default_factory=LoraConfig)


def normalize(cfg: DictConfig) -> None:
    """Fields left null are taken from the config.json of the Hugging Face dir `model.init_from`
    names, or of a run's `final/` exported with checkpoint.export_format=hf (`model=llama`: all
    of them); the user's own overrides stay. An architecture Loom's Llama does not reproduce
    is refused here, naming the supported ones. llama_tiny takes a tokenizer's vocabulary."""
    m = cfg.model
    if m.name in TOKENIZER_SIZED:
        checks.size_vocab_to_tokenizer(cfg)  # no-op with a checkpoint
    src = source_file(str(m.init_from)) if m.get("init_from") else None  # a run dir: its final/
    data = hf_config.read_config(src) if src is not None and src.is_dir() else None
    if data is None:
        return
    fields = hf_config.fields_from_config(data, str(m.init_from))
    for key, value in fields.items():
        if m.get(key) is None and (key != "rope_scaling" or m.name == "llama"):
            m[key] = value


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    for key in FIELDS:
        require(m.get(key) is not None, f"model.{key}", None,
                f"model={m.name} takes its shape from model.init_from's config.json: set model.init_from to "
                f"a Hugging Face dir (config.json + model.safetensors), or choose a sized option ({', '.join(SIZED)})")
    for key in ("n_layer", "n_head", "n_kv_heads", "d_model", "intermediate_size", "vocab_size", "block_size"):
        require(m[key] >= 1, f"model.{key}", m[key], "must be a positive integer")
    require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"must divide model.d_model={m.d_model}")
    require(m.n_head % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
            f"must divide model.n_head={m.n_head} (each key/value head serves a whole group of query "
            f"heads); valid: {', '.join(str(d) for d in checks.divisors(m.n_head))}")
    require(m.rms_norm_eps > 0, "model.rms_norm_eps", m.rms_norm_eps, "must be > 0")
    require(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be > 0")
    _check_rope_scaling(m)
    checks.needs_tokens(cfg)
    checks.within_context(cfg, int(m.block_size), "model.block_size")
    checks.vocab_covers_data(cfg, m.vocab_size)
    checks.check_split_heads(cfg, layout, int(m.n_kv_heads), "model.n_kv_heads", "key/value heads")
    if layout.pp > 1:
        checks.check_stages(cfg, layout, int(m.n_layer), "model.n_layer")
        checks.check_untied_for_stages(cfg, layout, bool(m.tie_embeddings), "model.tie_embeddings",
                                       "model.tie_embeddings=false")


def _check_rope_scaling(m: DictConfig) -> None:
    if m.rope_scaling is None:
        return
    keys = sorted(m.rope_scaling)
    require(keys == sorted(hf_config.ROPE_SCALING_KEYS), "model.rope_scaling", dict(m.rope_scaling),
            f"Llama-3.1 scaling has exactly the keys {', '.join(hf_config.ROPE_SCALING_KEYS)} (null: plain rotary)")
    r = m.rope_scaling
    require(r.factor > 0 and r.high_freq_factor > r.low_freq_factor > 0, "model.rope_scaling", dict(r),
            "needs factor > 0 and high_freq_factor > low_freq_factor > 0")


def parts(m: DictConfig) -> Parts:
    """The decoder under its TP plan (q/k/v/gate/up colwise, o/down rowwise, no bias on a
    row-parallel layer: only the two RMSNorm weights stay whole); no position table."""
    d, L, V, inner = int(m.d_model), int(m.n_layer), int(m.vocab_size), int(m.intermediate_size)
    q = int(m.n_head) * (d // int(m.n_head))
    head = 0 if m.tie_embeddings else V * d
    per_layer = (spec(m, 1).params - V * d - d - head) // L
    kv = int(m.n_kv_heads) * (d // int(m.n_head))
    # Measured (saved-tensor hooks on the network at h=512, varying kv and intermediate I),
    # bytes per token per layer: bf16 weights (FSDP2's policy, DeepSpeed) 20 h + 4 kv + 8 I;
    # under autocast over fp32 weights 10 h more (the fp32 residual stream into the norms); fp32
    # 32 h + 8 kv + 16 I. Every TP rank repeats RMSNorm's internals and the two matmul inputs;
    # q, the attention output and o_proj's input (6 h), k and v (4 kv) and SwiGLU's gate, up,
    # silu(gate) and product (8 I) are split over the TP ranks (twice the bytes in fp32).
    return Parts(per_layer=per_layer, per_layer_tp_whole=2 * d, first=V * d, last=d + head,
                 largest=max(inner * d, V * d, q * d), act_mixed=(14.0 * d, 6.0 * d + 4.0 * kv + 8.0 * inner),
                 act_fp32=(20.0 * d, 12.0 * d + 8.0 * kv + 16.0 * inner), act_autocast_extra=10.0 * d)


def spec(m: DictConfig, seq_len: int) -> ModelSpec:
    """GQA attention (n_kv_heads key/value heads), SwiGLU MLP (three d x intermediate
    matrices), two RMSNorm weights per layer and a final one, no positions (rotary), q/k/v
    biases when qkv_bias, and a head that is its own matrix unless tied.

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


def lora_targets(cfg: DictConfig) -> Targets:
    """The Linear modules (q/k/v/o, gate/up/down per layer; lm_head when untied)."""
    return {name.removesuffix(".weight"): (shape[1], shape[0]) for name, shape in hf_config.llama_shapes(cfg.model).items()
            if name.endswith("_proj.weight") or name == "lm_head.weight"}


def init_from_problems(cfg: DictConfig, path: Path, found: Shapes) -> list[str]:
    """A Llama from a Hugging Face dir: a tied head stored anyway is dropped from `found` (never
    read); once the tensors fit, a sized option's shape-free fields must agree with config.json."""
    m = cfg.model
    data = hf_config.read_config(path) if path.is_dir() else None
    if data is None:
        return []
    fields = hf_config.fields_from_config(data, str(path))
    if fields["tie_embeddings"] and m.tie_embeddings:
        found.pop("lm_head.weight", None)
    if m.name == "llama" or mismatches(hf_config.llama_shapes(m), found):
        return []
    return hf_config.field_mismatches(m, fields)


FAMILY = ModelFamily(
    name="llama*", options=OPTIONS, schema=LlamaModelConfig, check=check,
    spec=lambda cfg: spec(cfg.model, cfg.dataset.seq_len), build="loom.models.llama.module:build",
    shapes=lambda cfg: hf_config.llama_shapes(cfg.model), normalize=normalize,
    summary="Loom's Llama 2/3 decoder (GQA, SwiGLU, RoPE with 3.1 scaling); Qwen2 and Mistral checkpoints load",
    split_problem=lambda cfg, how: None, layers=lambda cfg: int(cfg.model.n_layer), width=lambda cfg: int(cfg.model.d_model),
    heads=lambda cfg: int(cfg.model.n_head), keys={"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_kv_heads"}, hf_config=lambda cfg: hf_config.config_from_fields(cfg.model),
    parts=lambda cfg: parts(cfg.model), largest=lambda cfg: float(parts(cfg.model).largest),
    document_masks=True, lora_targets=lora_targets, module_classes=hf_config.MODULE_CLASSES,
    init_from_problems=init_from_problems, context_parallel=lambda cfg: None,
    kv_heads=lambda cfg: int(cfg.model.n_kv_heads or cfg.model.n_head),
    hf_dir_option=lambda data: "llama" if (data.get("architectures") or [None])[0] in hf_config.SUPPORTED else None)
