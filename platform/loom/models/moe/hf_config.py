"""The MoE family's Hugging Face side, torch-free (the launcher runs it before torch): config.json
of Qwen3-MoE and Mixtral -> `model.*` fields and back, the state dict's names and shapes
(transformers 5's fused experts), and the per-expert layout other checkpoints use.

Two layouts of the routed experts are read:
- fused (transformers 5, and Loom's own): `mlp.experts.gate_up_proj` [E, 2I, d] (gate rows,
  then up rows) and `mlp.experts.down_proj` [E, d, I];
- per expert (transformers 4, the files Qwen and Mistral publish): `mlp.experts.{e}.gate_proj`,
  `up_proj` [I, d], `down_proj` [d, I]; Mixtral's `block_sparse_moe.experts.{e}.w1` (gate),
  `w3` (up), `w2` (down) and `block_sparse_moe.gate`.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.models.family import Shapes
from loom.models.llama.hf_config import read_config  # noqa: F401  (config.json, as the Llama family reads it)

# architecture -> (model_type, whether its attention normalizes q and k per head)
SUPPORTED = {"Qwen3MoeForCausalLM": ("qwen3_moe", True), "MixtralForCausalLM": ("mixtral", False)}
MODULE_CLASSES = ("MoEDecoderLayer", "Attention", "MoEBlock", "Experts", "Router", "RMSNorm", "Linear", "Embedding")
# fields that shape no tensor, compared between a sized option and its source's config.json
BEHAVIOUR_FIELDS = ("experts_per_token", "norm_topk_prob", "rope_theta", "rms_norm_eps")
# per-expert tensor names -> (fused tensor, which part): gate/up rows of gate_up_proj, or down_proj
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
PARTS = {"mlp": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe": ("w1", "w3", "w2")}  # gate, up, down
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _refuse(source: str, why: str) -> None:
    raise ConfigError(f"Invalid config: model.init_from={source!r}: {why}.")


def _unsupported(data: dict[str, Any], arch: str) -> list[str]:
    """What this config.json asks for that loom.models.moe does not compute."""
    out = []
    if data.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={data['hidden_act']}")
    if data.get("mlp_only_layers"):
        out.append(f"dense layers mlp_only_layers={data['mlp_only_layers']}")
    if int(data.get("decoder_sparse_step", 1)) != 1:
        out.append(f"decoder_sparse_step={data['decoder_sparse_step']}")
    if data.get("use_sliding_window") or (arch == "MixtralForCausalLM" and data.get("sliding_window")):
        out.append("sliding-window attention")
    if data.get("attention_bias"):
        out.append("attention_bias=true")
    return out


def fields_from_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json -> loom.models.moe's fields; a ConfigError naming what is not reproduced."""
    arch = (data.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        _refuse(source, f"config.json's architecture {arch} is not one Loom's MoE reproduces "
                f"(supported: {', '.join(SUPPORTED)})")
    unsupported = _unsupported(data, arch)
    if unsupported:
        _refuse(source, f"config.json asks for {', '.join(unsupported)}, which Loom's MoE does not compute")
    heads, d = int(data["num_attention_heads"]), int(data["hidden_size"])
    rope = {**(data.get("rope_scaling") or {}), **(data.get("rope_parameters") or {})}
    mixtral = arch == "MixtralForCausalLM"
    return {
        "n_layer": int(data["num_hidden_layers"]), "n_head": heads,
        "n_kv_heads": int(data.get("num_key_value_heads") or heads), "head_dim": int(data.get("head_dim") or d // heads),
        "d_model": d, "vocab_size": int(data["vocab_size"]), "block_size": int(data.get("max_position_embeddings") or 2048),
        # transformers 5 writes Qwen3-MoE's count as num_local_experts too (num_experts is its alias)
        "num_experts": int(data["num_local_experts"] if mixtral or "num_experts" not in data else data["num_experts"]),
        "experts_per_token": int(data["num_experts_per_tok"]),
        "moe_intermediate_size": int(data["intermediate_size"] if mixtral else data["moe_intermediate_size"]),
        "norm_topk_prob": True if mixtral else bool(data.get("norm_topk_prob", False)),
        "qk_norm": SUPPORTED[arch][1], "rope_theta": float(rope.get("rope_theta", data.get("rope_theta", 1e6))),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(data.get("tie_word_embeddings", False)),
    }


def field_mismatches(m: DictConfig, fields: dict[str, Any]) -> list[str]:
    return [f"model.{k}={m.get(k)} but config.json has {fields[k]}" for k in BEHAVIOUR_FIELDS if m.get(k) != fields[k]]


def moe_shapes(m: DictConfig) -> Shapes:
    """loom.models.moe's state dict, from the config (a test checks it against the module)."""
    d, V, E, inner = int(m.d_model), int(m.vocab_size), int(m.num_experts), int(m.moe_intermediate_size)
    hd, shared = int(m.head_dim), int(m.shared_intermediate_size or 0)
    q, kv = int(m.n_head) * hd, int(m.n_kv_heads) * hd
    out: Shapes = {"model.embed_tokens.weight": (V, d)}
    for i in range(int(m.n_layer)):
        a, f = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {f"{a}q_proj.weight": (q, d), f"{a}k_proj.weight": (kv, d), f"{a}v_proj.weight": (kv, d),
                f"{a}o_proj.weight": (d, q)}
        if m.qk_norm:
            out |= {f"{a}q_norm.weight": (hd,), f"{a}k_norm.weight": (hd,)}
        out |= {f"{f}gate.weight": (E, d), f"{f}experts.gate_up_proj": (E, 2 * inner, d),
                f"{f}experts.down_proj": (E, d, inner)}
        if m.bias_update_rate:
            out[f"{f}gate.e_score_correction_bias"] = (E,)
        if shared:
            out |= {f"{f}shared_experts.gate_proj.weight": (shared, d), f"{f}shared_experts.up_proj.weight": (shared, d),
                    f"{f}shared_experts.down_proj.weight": (d, shared)}
        out |= {f"model.layers.{i}.input_layernorm.weight": (d,), f"model.layers.{i}.post_attention_layernorm.weight": (d,)}
    out["model.norm.weight"] = (d,)
    if not m.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


def fused_view(found: Shapes) -> Shapes:
    """A checkpoint's names and shapes as the fused layout: per-expert tensors become the
    `gate_up_proj` / `down_proj` they fill (expert count = the highest index + 1, which the
    shape check then compares), Mixtral's `block_sparse_moe.gate` becomes `mlp.gate`. A
    per-expert set with an expert or a part missing keeps those names, so the check names them."""
    out: Shapes = {}
    experts: dict[tuple[str, str], dict[int, tuple[int, ...]]] = {}
    for name, shape in found.items():
        hit = PER_EXPERT.match(name)
        if hit is None:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = tuple(shape)
            continue
        experts.setdefault((hit[1], PART[hit[4]]), {})[int(hit[3])] = tuple(shape)
    for layer in sorted({k[0] for k in experts}, key=int):
        gate, up, down = (experts.get((layer, p), {}) for p in ("gate", "up", "down"))
        E = max([*gate, *up, *down]) + 1
        complete = all(len(part) == E for part in (gate, up, down))
        if not complete:
            out |= {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": s
                    for p, part in (("gate", gate), ("up", up), ("down", down)) for e, s in part.items()}
            continue
        inner, d = gate[0]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (E, 2 * inner, d)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = (E, *down[0])
    return out


def missing_experts(found: Shapes) -> list[str]:
    """The per-expert tensors a checkpoint lacks, in its own names: in each layer holding some,
    every expert up to the highest index found needs its gate, up and down weight (an expert
    missing whole at the top shows instead as the fused shape's smaller expert count)."""
    held: dict[tuple[str, str], set[str]] = {}
    for name in found:
        hit = PER_EXPERT.match(name)
        if hit is not None:
            held.setdefault((hit[1], hit[2]), set()).add(name)
    out = []
    for (layer, block), names in sorted(held.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        count = max(int(PER_EXPERT.match(n)[3]) for n in names) + 1
        out += [n for e in range(count) for part in PARTS[block]
                if (n := f"model.layers.{layer}.{block}.experts.{e}.{part}.weight") not in names]
    return out


def check_experts(found: Shapes, source: str, option: str) -> None:
    """Refuse a per-expert checkpoint with an expert's tensor missing, naming it (before launch:
    the fused view alone would name only the fused tensors it cannot fill)."""
    missing = missing_experts(found)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ConfigError(f"Invalid config: model.init_from={source!r} does not fit model={option}: "
                          f"{len(missing)} per-expert tensor(s) missing from the file: {', '.join(missing[:8])}{more}. "
                          "Every expert of a layer needs its gate, up and down weight: the checkpoint is "
                          "incomplete (a shard missing from the download, or a partial conversion).")


def per_expert_names(name: str, keys: set[str]) -> tuple[list[str], list[str]] | None:
    """For a fused expert tensor, the checkpoint's per-expert tensors holding it: (gate names,
    up names) for `gate_up_proj`, ([down names], []) for `down_proj`; None when it holds the fused one."""
    hit = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
    if hit is None or name in keys:
        return None
    layer, which = hit[1], hit[2]
    for block, gate, up, down in (("mlp", "gate_proj", "up_proj", "down_proj"), ("block_sparse_moe", "w1", "w3", "w2")):
        pre = f"model.layers.{layer}.{block}.experts."
        n = sum(1 for k in keys if k.startswith(pre) and k.endswith(f".{gate}.weight"))
        if n:
            g, u, dn = ([f"{pre}{e}.{part}.weight" for e in range(n)] for part in (gate, up, down))
            return (g, u) if which == "gate_up_proj" else (dn, [])
    return None


def config_from_fields(m: DictConfig, dtype: str = "float32") -> dict[str, Any]:
    """loom.models.moe's fields -> a config.json transformers builds the same network from:
    Qwen3MoeForCausalLM with q/k norms, MixtralForCausalLM without."""
    mixtral = not m.qk_norm
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if mixtral else "Qwen3MoeForCausalLM"],
        "model_type": "mixtral" if mixtral else "qwen3_moe",
        "hidden_size": int(m.d_model), "num_hidden_layers": int(m.n_layer), "num_attention_heads": int(m.n_head),
        "num_key_value_heads": int(m.n_kv_heads), "head_dim": int(m.head_dim), "vocab_size": int(m.vocab_size),
        "max_position_embeddings": int(m.block_size), "rms_norm_eps": float(m.rms_norm_eps),
        "rope_theta": float(m.rope_theta), "tie_word_embeddings": bool(m.tie_embeddings), "hidden_act": "silu",
        "num_experts_per_tok": int(m.experts_per_token), "attention_dropout": 0.0, "initializer_range": 0.02,
        "router_aux_loss_coef": float(m.aux_loss_coef), "output_router_logits": False, "torch_dtype": dtype,
    }
    if mixtral:
        return config | {"num_local_experts": int(m.num_experts), "intermediate_size": int(m.moe_intermediate_size),
                         "sliding_window": None}
    return config | {"num_experts": int(m.num_experts), "moe_intermediate_size": int(m.moe_intermediate_size),
                     "intermediate_size": int(m.moe_intermediate_size), "norm_topk_prob": bool(m.norm_topk_prob),
                     "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                     "sliding_window": None, "attention_bias": False}
