"""The schemas of the model options (conf/model/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoraConfig:
    """`model.lora`: LoRA adapters through peft (loom.models.lora); r=0: off, the full model trains."""

    r: int = 0                        # the adapters' rank; > 0 freezes the base and trains adapters only
    alpha: float = 16.0               # peft's lora_alpha: the update is scaled by alpha / r
    dropout: float = 0.0              # peft's lora_dropout, on the adapter's input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # Linear module names


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


@dataclass
class LlamaModelConfig:
    """loom.models.llama (conf/model/llama*.yaml). A null field is filled from the config.json
    of the Hugging Face directory `init_from` names (`model=llama`: every shape comes from it)."""

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


@dataclass
class MLPModelConfig:
    name: str = "mlp"
    in_features: int | None = None    # null: from the dataset (digits: 64)
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    num_classes: int | None = None    # null: from the dataset (digits: 10)
    dropout: float = 0.0
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


@dataclass
class HFCausalLMModelConfig:
    name: str = "hf_causal_lm"
    config: str | None = None         # a local dir with config.json, or a name in the HF cache
    # set on the AutoConfig: any key of its class, checked before launch (models.hf_checks), e.g. {n_layer: 2}
    overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None     # null: the config's
    random_init: bool = False         # false: load the weights when they are local, else random
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class CustomModelConfig:
    name: str = "custom"
    # `_target_` (+ its keyword arguments): a LightningModule, or an nn.Module trained with `loss`
    module: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime


# Loom's GPT family: one schema, several sizes (conf/model/gpt_*.yaml).
GPT_SIZES = ("gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b")
# The Llama family: sized options, and `llama` whose sizes come from model.init_from's config.json.
LLAMA_OPTIONS = ("llama_tiny", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b", "llama")
