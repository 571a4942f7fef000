"""The Llama family's Hugging Face side, torch-free (the launcher runs it before any import of
torch): config.json -> Loom's `model.*` fields, the architectures loom.models.llama reproduces
exactly, and the names and shapes of its state dict, which are Hugging Face's own
(`model.layers.N.self_attn.q_proj.weight`, ...): import and export are a copy by name.

config.json comes in two spellings: transformers 4 (and the files Meta and Qwen publish) write
`rope_theta` + `rope_scaling` ({rope_type: llama3, factor, ...} or null); transformers 5 writes
both into `rope_parameters`. Both are read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.models.family import Shapes

# architecture (config.json "architectures"[0]) -> whether its q/k/v projections carry biases
# (Mistral is Llama's network with an optional sliding window: accepted without one)
SUPPORTED = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True, "MistralForCausalLM": False}
# llama3 rotary scaling: each key with its JSON type (transformers warns on every load of a config.json
# whose original_max_position_embeddings is not an integer; the model schema holds them all as floats)
ROPE_SCALING_TYPES: dict[str, type] = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
                                       "original_max_position_embeddings": int}
ROPE_SCALING_KEYS = tuple(ROPE_SCALING_TYPES)
# fields that shape no tensor, compared between a sized option and the config.json of its source
BEHAVIOUR_FIELDS = ("rope_theta", "rope_scaling", "rms_norm_eps")
# module classes of loom.models.llama (strategy.shard_units names them before torch is imported)
MODULE_CLASSES = ("DecoderLayer", "Attention", "MLP", "RMSNorm", "Linear", "Embedding")



def read_config(directory: Path) -> dict[str, Any] | None:
    """config.json of a Hugging Face directory; None when there is none."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        return None
    data = json.loads(f.read_text())
    return data if isinstance(data, dict) else None


def _refuse(source: str, why: str) -> None:
    raise ConfigError(f"Invalid config: model.init_from={source!r}: {why}.")


def _rope(data: dict[str, Any], source: str) -> tuple[float, dict[str, float] | None]:
    """(rope_theta, llama3 scaling or None) from either spelling of config.json."""
    rope = {**(data.get("rope_scaling") or {}), **(data.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", data.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        _refuse(source, f"config.json's rotary scaling rope_type={kind!r} is not one Loom's Llama has "
                "(default, llama3); use model=hf_causal_lm model.config=<this dir> for it")
    missing = [k for k in ROPE_SCALING_KEYS if k not in rope]
    if missing:
        _refuse(source, f"config.json's llama3 rotary scaling lacks {', '.join(missing)}")
    return theta, {k: float(rope[k]) for k in ROPE_SCALING_KEYS}


def _unsupported_features(data: dict[str, Any], arch: str) -> list[str]:
    """What this config.json asks for that loom.models.llama does not compute."""
    out = []
    d, heads = data.get("hidden_size"), data.get("num_attention_heads")
    if data.get("head_dim") not in (None, (d // heads) if d and heads else None):
        out.append(f"head_dim={data['head_dim']} (Loom's is hidden_size / num_attention_heads)")
    if data.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={data['hidden_act']}")
    if arch == "LlamaForCausalLM" and data.get("attention_bias"):
        out.append("attention_bias=true (o_proj bias)")
    if data.get("mlp_bias"):
        out.append("mlp_bias=true")
    if data.get("use_sliding_window") or "sliding_attention" in (data.get("layer_types") or []):
        out.append("sliding-window attention")
    window, longest = data.get("sliding_window"), data.get("max_position_embeddings")
    if arch == "MistralForCausalLM" and window is not None and (longest is None or window < longest):
        out.append(f"sliding-window attention (sliding_window={window} < max_position_embeddings={longest})")
    return out


def fields_from_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json -> loom.models.llama's fields; a ConfigError when the architecture or one of
    its features is not reproduced (the message names the supported ones and the fallback)."""
    arch = (data.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        _refuse(source, f"config.json's architecture {arch} is not one Loom's Llama reproduces "
                f"(supported: {', '.join(SUPPORTED)}); for any other transformers decoder use "
                f"model=hf_causal_lm model.config={source}")
    unsupported = _unsupported_features(data, arch)
    if unsupported:
        _refuse(source, f"config.json asks for {', '.join(unsupported)}, which Loom's Llama does not "
                f"compute; use model=hf_causal_lm model.config={source}")
    theta, scaling = _rope(data, source)
    heads = int(data["num_attention_heads"])
    return {
        "n_layer": int(data["num_hidden_layers"]), "n_head": heads,
        "n_kv_heads": int(data.get("num_key_value_heads") or heads), "d_model": int(data["hidden_size"]),
        "intermediate_size": int(data["intermediate_size"]), "vocab_size": int(data["vocab_size"]),
        "block_size": int(data.get("max_position_embeddings") or 2048),
        "rope_theta": theta, "rope_scaling": scaling, "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(data.get("tie_word_embeddings", False)), "qkv_bias": SUPPORTED[arch],
    }


def field_mismatches(m: DictConfig, fields: dict[str, Any]) -> list[str]:
    """The shape-free fields where a sized option differs from its source's config.json."""
    out = []
    for key in BEHAVIOUR_FIELDS:
        mine = m.get(key)
        mine = dict(mine) if isinstance(mine, DictConfig) else mine
        if mine != fields[key]:
            out.append(f"model.{key}={mine} but config.json has {fields[key]}")
    return out


def llama_shapes(m: DictConfig) -> Shapes:
    """loom.models.llama's state dict, from the config (a test checks it against the module)."""
    d, V, inner = int(m.d_model), int(m.vocab_size), int(m.intermediate_size)
    hd = d // int(m.n_head)
    q, kv = int(m.n_head) * hd, int(m.n_kv_heads) * hd
    out: Shapes = {"model.embed_tokens.weight": (V, d)}
    for i in range(int(m.n_layer)):
        a, f = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {f"{a}q_proj.weight": (q, d), f"{a}k_proj.weight": (kv, d), f"{a}v_proj.weight": (kv, d),
                f"{a}o_proj.weight": (d, q)}
        if m.qkv_bias:
            out |= {f"{a}q_proj.bias": (q,), f"{a}k_proj.bias": (kv,), f"{a}v_proj.bias": (kv,)}
        out |= {f"{f}gate_proj.weight": (inner, d), f"{f}up_proj.weight": (inner, d),
                f"{f}down_proj.weight": (d, inner),
                f"model.layers.{i}.input_layernorm.weight": (d,),
                f"model.layers.{i}.post_attention_layernorm.weight": (d,)}
    out["model.norm.weight"] = (d,)
    if not m.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    return out


def config_from_fields(m: DictConfig, dtype: str = "float32") -> dict[str, Any]:
    """loom.models.llama's fields -> a config.json `transformers` builds the same network from
    (the inverse of `fields_from_config`, in the transformers 4 spelling Meta publishes, which
    transformers 5 reads too): LlamaForCausalLM, or Qwen2ForCausalLM when q/k/v carry biases."""
    qwen = bool(m.qkv_bias)
    scaling = m.get("rope_scaling")
    heads = int(m.n_head)
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "hidden_size": int(m.d_model), "intermediate_size": int(m.intermediate_size),
        "num_hidden_layers": int(m.n_layer), "num_attention_heads": heads,
        "num_key_value_heads": int(m.n_kv_heads), "head_dim": int(m.d_model) // heads,
        "vocab_size": int(m.vocab_size), "max_position_embeddings": int(m.block_size),
        "rms_norm_eps": float(m.rms_norm_eps), "rope_theta": float(m.rope_theta),
        "rope_scaling": ({"rope_type": "llama3", **{k: kind(scaling[k]) for k, kind in ROPE_SCALING_TYPES.items()}}
                         if scaling else None),
        "tie_word_embeddings": bool(m.tie_embeddings), "hidden_act": "silu",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,
    }
    if qwen:
        config |= {"use_sliding_window": False, "sliding_window": None}
    else:
        config |= {"attention_bias": False, "mlp_bias": False}
    return config
