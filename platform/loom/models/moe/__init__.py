"""The mixture-of-experts family (`model=moe*`, `qwen3_moe_*`: Qwen3-MoE, Mixtral), its torch-free
half: schema, checks, parameter, active-parameter and FLOP counts, the plan's parts, the state
dict's shapes and the Hugging Face config it reads and writes (`hf_config`). The torch half:
`network` (the decoder, its router and experts, init rule), `dispatch` (tokens to experts, local
or all-to-all) and `module` (its LightningModule, balance loss, expert-load metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import require
from loom.layout import ParallelLayout
from loom.models import checks
from loom.models.family import ModelFamily, Shapes
from loom.models.init_from import mismatches, source_file
from loom.models.moe import hf_config
from loom.models.spec import ModelSpec, Parts

OPTIONS = ("moe_tiny", "qwen3_moe_30b_a3b", "moe")
SIZED = tuple(o for o in OPTIONS if o != "moe")
SHAPE_FIELDS = ("n_layer", "n_head", "n_kv_heads", "head_dim", "d_model", "vocab_size", "block_size",
                "num_experts", "experts_per_token", "moe_intermediate_size")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEModelConfig:
    """loom.models.moe.network (conf/model/moe*.yaml). A null field is filled from the config.json
    of the Hugging Face directory `init_from` names (`model=moe`: every shape)."""

    name: str = "moe_tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None          # per attention head (Qwen3: not d_model / n_head)
    d_model: int | None = None
    vocab_size: int | None = None
    block_size: int | None = None
    num_experts: int | None = None       # routed experts per layer
    experts_per_token: int | None = None  # the router's top-k
    moe_intermediate_size: int | None = None  # each expert's SwiGLU width
    shared_intermediate_size: int = 0    # shared experts' SwiGLU width (0: none; DeepSeek-style)
    score_func: str = "softmax"          # softmax (Qwen3-MoE, Mixtral) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool | None = None   # renormalize the chosen k scores to sum to 1
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.001         # sequence-wise balance loss weight (0: off)
    bias_update_rate: float = 0.0        # aux-loss-free balancing's bias step (0: off; DeepSeek-V3: 0.001)
    grouped_mm: bool = True              # torch._grouped_mm for the experts (else, or where it cannot run, a loop)
    qk_norm: bool | None = None          # RMSNorm on each q/k head (Qwen3-MoE); false: Mixtral
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_from: str | None = None
    init_from_fingerprint: str | None = None
    vocab_used: int | None = None


def normalize(cfg: DictConfig) -> None:
    """Null fields from `model.init_from`'s config.json (`model=moe`: all of them)."""
    m = cfg.model
    src = source_file(str(m.init_from)) if m.get("init_from") else None
    data = hf_config.read_config(src) if src is not None and src.is_dir() else None
    if data is None:
        return
    for key, value in hf_config.fields_from_config(data, str(m.init_from)).items():
        if m.get(key) is None:
            m[key] = value


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    for key in (*SHAPE_FIELDS, "norm_topk_prob", "qk_norm", "rope_theta", "rms_norm_eps", "tie_embeddings"):
        require(m.get(key) is not None, f"model.{key}", None,
                f"model={m.name} takes its shape from model.init_from's config.json: set model.init_from to a "
                f"Hugging Face dir, or choose a sized option ({', '.join(SIZED)})")
    for key in SHAPE_FIELDS:
        require(m[key] >= 1, f"model.{key}", m[key], "must be a positive integer")
    require(m.n_head % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
            f"must divide model.n_head={m.n_head}; valid: {', '.join(map(str, checks.divisors(m.n_head)))}")
    require(m.experts_per_token <= m.num_experts, "model.experts_per_token", m.experts_per_token,
            f"the router picks top-k of model.num_experts={m.num_experts} experts: k must be at most that")
    require(m.score_func in SCORE_FUNCS, "model.score_func", m.score_func, f"one of {', '.join(SCORE_FUNCS)}")
    require(m.shared_intermediate_size >= 0, "model.shared_intermediate_size", m.shared_intermediate_size, "must be >= 0")
    require(m.aux_loss_coef >= 0 and m.bias_update_rate >= 0, "model.aux_loss_coef", m.aux_loss_coef,
            "the balance loss weight and model.bias_update_rate must be >= 0")
    checks.needs_tokens(cfg)
    checks.within_context(cfg, int(m.block_size), "model.block_size")
    checks.vocab_covers_data(cfg, m.vocab_size)


def spec(m: DictConfig, seq_len: int) -> ModelSpec:
    """Counts with every expert, and `active_params`: what one token passes through (the
    router's k experts of E, the shared experts, attention, norms, embedding and head).
    FLOPs per token: 6 x active matmul parameters + 12 L (n_head head_dim) T (PaLM appendix B
    on the active network), so MFU is on active parameters, as DeepSeek and torchtitan report it."""
    d, L, V, E, k = int(m.d_model), int(m.n_layer), int(m.vocab_size), int(m.num_experts), int(m.experts_per_token)
    hd, inner, shared = int(m.head_dim), int(m.moe_intermediate_size), int(m.shared_intermediate_size or 0)
    q, kv = int(m.n_head) * hd, int(m.n_kv_heads) * hd
    attention = 2 * d * q + 2 * d * kv + (2 * hd if m.qk_norm else 0)
    expert = 3 * d * inner
    dense = attention + E * d + 3 * d * shared + 2 * d  # router, shared experts, the two norms
    bias = E if m.bias_update_rate else 0  # a buffer, counted as the state dict holds it
    head = 0 if m.tie_embeddings else V * d
    total = V * d + L * (dense + E * expert + bias) + d + head
    active = V * d + L * (dense + k * expert) + d + head
    matmul = L * (attention - (2 * hd if m.qk_norm else 0) + E * d + 3 * d * shared + k * expert) + V * d
    flops = 6 * matmul + 12 * L * q * seq_len
    return ModelSpec(total, total - V * d, float(flops), L, d, seq_len, matmul, active_params=active)


def parts(m: DictConfig) -> Parts:
    """Where the parameters sit for the plan (no TP plan of its own yet: the whole layer is
    counted as split-free).

    Activations, measured (saved-tensor hooks on one bf16 layer at d=512, varying d, q, kv, k,
    I and E, within 1%), bytes per token per layer: 16 d (norms, residuals, attention input and
    output) + 10 (q + kv) (q/k/v, their normed and rotated copies, SDPA's output) + k (4 d + 8 I)
    per routed copy (the gathered input, gate/up output, silu and product, the expert output
    before weighting) + 4 E (the router's fp32 scores). In fp32, twice the bytes."""
    d, V, k = int(m.d_model), int(m.vocab_size), int(m.experts_per_token)
    inner, E, hd = int(m.moe_intermediate_size), int(m.num_experts), int(m.head_dim)
    q, kv = int(m.n_head) * hd, int(m.n_kv_heads) * hd
    head = 0 if m.tie_embeddings else V * d
    per_layer = (spec(m, 1).params - V * d - d - head) // int(m.n_layer)
    whole = 16.0 * d + k * (4.0 * d + 8.0 * inner) + 4.0 * E
    split = 10.0 * (q + kv)
    return Parts(per_layer=per_layer, per_layer_tp_whole=per_layer, first=V * d, last=d + head,
                 largest=max(E * 2 * inner * d, V * d), act_mixed=(whole, split), act_fp32=(2 * whole, 2 * split),
                 act_autocast_extra=10.0 * d)


def expert_params(m: DictConfig) -> int:
    """The routed experts' parameters (what expert parallelism divides by strategy.ep)."""
    return int(m.n_layer) * int(m.num_experts) * 3 * int(m.d_model) * int(m.moe_intermediate_size)


def init_from_problems(cfg: DictConfig, path: Path, found: Shapes) -> list[str]:
    """A per-expert checkpoint with an expert's tensor missing is refused naming it; a complete one
    is compared as the fused tensors it fills (`found` rewritten in place); once shapes agree, a
    sized option's behaviour fields must agree with config.json."""
    hf_config.check_experts(found, str(path), cfg.model.name)
    fused = hf_config.fused_view(found)
    found.clear()
    found.update(fused)
    m = cfg.model
    data = hf_config.read_config(path) if path.is_dir() else None
    if data is None:
        return []
    fields = hf_config.fields_from_config(data, str(path))
    if fields["tie_embeddings"] and m.tie_embeddings:
        found.pop("lm_head.weight", None)
    if m.name == "moe" or mismatches(hf_config.moe_shapes(m), found):
        return []
    return hf_config.field_mismatches(m, fields)


def split_problem(cfg: DictConfig, how: str) -> str:
    """Not split by tensor or pipeline parallelism yet: its experts split by strategy.ep."""
    return (f"model={cfg.model.name} has no {how.replace('_', ' ')} plan yet: train it data-parallel "
            "(strategy=ddp, fsdp or zero1-3), its experts split by strategy.ep under fsdp or nd")


FAMILY = ModelFamily(
    name="moe", options=OPTIONS, schema=MoEModelConfig, check=check,
    spec=lambda cfg: spec(cfg.model, cfg.dataset.seq_len), build="loom.models.moe.module:build",
    shapes=lambda cfg: hf_config.moe_shapes(cfg.model), normalize=normalize,
    summary="Loom's mixture of experts (Qwen3-MoE, Mixtral): dropless top-k router, grouped-matmul experts",
    splits_note="experts by strategy.ep (fsdp, nd); no tensor or pipeline split yet", split_problem=split_problem,
    layers=lambda cfg: int(cfg.model.n_layer), width=lambda cfg: int(cfg.model.d_model),
    heads=lambda cfg: int(cfg.model.n_head), keys={"layers": "model.n_layer", "heads": "model.n_head", "kv_heads": "model.n_kv_heads"},
    hf_config=lambda cfg: hf_config.config_from_fields(cfg.model), parts=lambda cfg: parts(cfg.model),
    largest=lambda cfg: float(parts(cfg.model).largest), module_classes=hf_config.MODULE_CLASSES,
    init_from_problems=init_from_problems, experts=lambda cfg: int(cfg.model.num_experts),
    experts_per_token=lambda cfg: int(cfg.model.experts_per_token),
    expert_params=lambda cfg: expert_params(cfg.model), context_parallel=lambda cfg: None,
    kv_heads=lambda cfg: int(cfg.model.n_kv_heads or cfg.model.n_head),
    hf_dir_option=lambda data: "moe" if (data.get("architectures") or [None])[0] in hf_config.SUPPORTED else None)
