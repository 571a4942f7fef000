"""Any transformers decoder (`model=hf_causal_lm`), its torch-free half as far as it goes: the
schema, checks (config.json read as JSON first, then against transformers' config class:
`checks`), counts from the meta-device build, LoRA targets, and whether the architecture's own
`base_model_tp_plan` / `base_model_pp_plan` let Loom split it (`parallel`). The torch half:
`config` (the build), `parallel` (those plans applied on Loom's mesh) and `module`."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.data import items_per_sample
from loom.errors import fail, require
from loom.layout import ParallelLayout
from loom.models import checks as shared_checks
from loom.models.family import ModelFamily, Shapes, Targets
from loom.models.hf import checks as hf_checks
from loom.models.hf import config as hf
from loom.models.init_from import state_shapes
from loom.models.schema import LoraConfig
from loom.models.spec import ModelSpec, Parts


@dataclass
class HFCausalLMModelConfig:
    name: str = "hf_causal_lm"
    config: str | None = None         # a local dir with config.json, or a name in the HF cache
    # set on the AutoConfig: any key of its class, checked before launch (hf.checks), e.g. {n_layer: 2}
    overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None     # null: the config's
    random_init: bool = False         # false: load the weights when they are local, else random
    init_from: str | None = None      # a run dir (its final weights) or a .safetensors file
    init_from_fingerprint: str | None = None  # set by Loom: the file's size and mtime
    head: str = "lm"                  # lm: the causal LM | score: a scalar per sequence (loom.models.heads)
    lora: LoraConfig = field(default_factory=LoraConfig)


def normalize(cfg: DictConfig) -> None:
    """A local config dir is frozen absolute: ranks and resumes may start elsewhere; an alias
    key of `model.overrides` is frozen as the config's own key."""
    from pathlib import Path

    m = cfg.model
    if m.config:
        p = Path(str(m.config)).expanduser()
        if p.exists():
            m.config = str(p.resolve())
    hf_checks.canonical_overrides(cfg)  # an alias (num_hidden_layers) -> its config's key (GPT-2: n_layer)


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    """config.json read as JSON first (torch-free refusals), then against transformers' class."""
    m = cfg.model
    require(bool(m.config), "model.config", m.config,
             "name a directory holding a transformers config.json (save_pretrained), or a model "
             "name already in the Hugging Face cache, e.g. model.config=/models/my-gpt2")
    try:
        data = hf.config_dict(m)
    except (FileNotFoundError, ValueError, OSError):
        fail("model.config", m.config,
              "has no config.json locally (not a directory with one, nor a name in the Hugging Face "
              "cache); Loom does not download models: save one with "
              "transformers.AutoConfig...save_pretrained(dir) and pass the directory")
    shared_checks.needs_tokens(cfg)
    hf_checks.check_head(cfg, data, layout)
    loaded = not m.random_init and not m.get("init_from") and hf.has_local_weights(str(m.config))
    _hf_context(cfg, data, loaded)
    vocab = data.get("vocab_size")
    if isinstance(vocab, int):
        also = (" model.random_init=true (the weights in model.config have a smaller vocabulary: "
                "its new rows cannot come from them)") if loaded else ""
        shared_checks.vocab_covers_data(cfg, vocab, "model.vocab_size" if m.vocab_size is not None else "model.config.vocab_size", also)
    hf_checks.check_architecture(cfg)  # overrides, the build, the implicit weights (transformers)
    _check_splits(cfg, layout)


def _hf_context(cfg: DictConfig, data: dict, loaded: bool) -> None:
    """dataset.seq_len within the config's context; the advice raises the config's own key, and
    adds model.random_init=true where that key sizes a position table the loaded weights hold."""
    key, seq = hf.context_key(data), cfg.dataset.seq_len
    if key is None or seq <= data[key]:
        return
    raise_it = f"model.overrides.{key}={seq}"
    if loaded and not hf_checks.fits_weights(cfg, {**hf.overrides_of(cfg.model), key: seq}):
        raise_it += " model.random_init=true (a longer position table than the weights hold)"
    fail("dataset.seq_len", seq, f"exceeds the model's context ({key}={data[key]}, from model.config="
          f"{cfg.model.config}); lower dataset.seq_len to {data[key]} or set {raise_it}")


def plans(config: Any) -> dict[str, dict]:
    """The architecture's own tensor- and pipeline-parallel plans (transformers' config class
    attributes `base_model_tp_plan`, `base_model_pp_plan`; empty: none)."""
    return {"tp": dict(getattr(config, "base_model_tp_plan", None) or {}),
            "pp": dict(getattr(config, "base_model_pp_plan", None) or {})}


def heads_of(config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (0: it has none)."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    return heads, int(getattr(config, "num_key_value_heads", 0) or heads)


def split_problem(cfg: DictConfig, how: str) -> str | None:
    """Why this architecture cannot be split `how`: it declares no plan of that kind."""
    config = hf.auto_config(cfg.model)
    plan = plans(config)["tp" if how == "tensor_parallel" else "pp"]
    if plan:
        return None
    kind = "base_model_tp_plan" if how == "tensor_parallel" else "base_model_pp_plan"
    return f"its architecture ({type(config).__name__}) declares no {kind}"


def _check_splits(cfg: DictConfig, layout: ParallelLayout) -> None:
    """What the architecture's own plans need: styles Loom applies, tp dividing the heads and
    key/value heads, no tied head across pipeline stages, a layer per stage."""
    if layout.tp <= 1 and layout.pp <= 1:
        return
    from loom.models.hf import parallel

    config = hf.auto_config(cfg.model)
    own = plans(config)
    s = cfg.strategy
    if layout.tp > 1 and own["tp"]:
        problem = parallel.tp_problem(own["tp"], layout.tp, *heads_of(config))
        require(problem is None, "strategy.tp" if "tp" in s else "strategy.tensor_parallel", layout.tp,
                f"model={cfg.model.name} ({type(config).__name__}): {problem}")
    if layout.pp > 1 and own["pp"]:
        problem = parallel.pp_problem(own["pp"], bool(getattr(config, "tie_word_embeddings", False)),
                                      int(config.num_hidden_layers), layout.pp)
        require(problem is None, "strategy.pp", layout.pp, f"model={cfg.model.name} ({type(config).__name__}): {problem}")


def largest(cfg: DictConfig) -> float:
    """A transformers decoder's largest parameter from its config: max(4*d*d, vocab*d)."""
    c = hf.config_dict(cfg.model)
    d = next((c[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(c.get(k), int)), 0)
    return float(max(4 * d * d, int(c.get("vocab_size") or 0) * d))


def spec(cfg: DictConfig) -> ModelSpec:
    """A transformers decoder, counted from its meta-device build. FLOPs per token: 6N + 12 * Q * the
    sum over layers of the keys attended (seq_len, or a sliding window: hf.attention_spans), Q =
    heads x head_dim (Gemma's head_dim is not hidden_size / heads)."""
    T = items_per_sample(cfg)
    params, embedding, L, d, tied = hf.count(cfg.model)
    non_embedding = params - embedding
    head = hf.config_dict(cfg.model).get("vocab_size", 0) * d if tied else 0  # tied: a matmul, no params
    # each layer's window where it has one (hf.attention_spans); a sequence's keys, not a sample's items
    q, spans = hf.attention_spans(cfg.model, int(cfg.dataset.seq_len))
    flops = 6 * (non_embedding + head) + 12 * q * sum(spans) if L and d else None
    return ModelSpec(params, non_embedding, float(flops) if flops else None, L, d, T, non_embedding + head)


def shapes(cfg: DictConfig) -> Shapes:
    """A transformers architecture's state dict, built on the meta device (imports torch): the
    causal LM's whatever `model.head`, as model.init_from holds a causal LM's weights (under
    model.head=score its base's names map, its lm_head is unused and the score head is drawn)."""
    m = OmegaConf.create(OmegaConf.to_container(cfg.model))
    m.head = "lm"
    return state_shapes(hf.meta_model(m))



def lora_targets(cfg: DictConfig) -> Targets:
    """A transformers model's Linear (and GPT-2 Conv1D) modules, from its meta-device build."""
    m = OmegaConf.to_container(cfg.model)
    m.pop("lora", None)  # the network does not depend on it: one build for every lora setting
    return dict(_hf_targets(json.dumps(m, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=8)
def _hf_targets(key: str) -> tuple[tuple[str, tuple[int, int]], ...]:
    import torch

    model = hf.meta_model(OmegaConf.create(json.loads(key)))
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out.append((name, (mod.in_features, mod.out_features)))
        elif type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None:  # GPT-2: (in, out)
            out.append((name, (int(mod.weight.shape[0]), int(mod.weight.shape[1]))))
    return tuple(out)




def weights_dir(cfg: DictConfig) -> tuple[Path | None, str]:
    """`model.config` when it holds the weights the run started from (no model.random_init, no
    model.overrides), else (None, why)."""
    m = cfg.model
    config = Path(str(m.get("config") or "")).expanduser()
    if not (m.get("config") and (config / "config.json").is_file()):
        return None, "the base was initialized by Loom from the seed (no model.init_from), which no directory holds"
    if m.get("random_init") or m.get("overrides") or not hf.has_local_weights(str(config)):
        return None, (f"the base started from model.config={m.config} "
                      f"{'with model.overrides' if m.get('overrides') else 'without its weights'}, which no "
                      "directory holds")
    return config, ""


@functools.lru_cache(maxsize=8)
def _parts(key: str) -> Parts:
    p = hf.parts(OmegaConf.create(json.loads(key)))
    h, kv, inner = p.pop("width"), p.pop("kv"), p.pop("inner")
    # Llama's measured bytes per token per layer (loom.models.llama.parts), on this architecture's
    # widths: every TP rank repeats the norms' internals and the matmul inputs (14 h in 16-bit), q,
    # the attention output and o_proj's input (6 h), k and v (4 kv) and the MLP's gate, up, act and
    # product (8 I) split over the TP ranks; twice the bytes in fp32; autocast keeps 10 h in fp32
    return Parts(**p, act_mixed=(14.0 * h, 6.0 * h + 4.0 * kv + 8.0 * inner),
                 act_fp32=(20.0 * h, 12.0 * h + 8.0 * kv + 16.0 * inner), act_autocast_extra=10.0 * h)


def parts(cfg: DictConfig) -> Parts | None:
    """Where the decoder's parameters sit (the plan's pipeline stages, TP, activations); None for
    an architecture without a pipeline plan (not a layered decoder Loom can place)."""
    if not plans(hf.auto_config(cfg.model))["pp"]:
        return None
    m = OmegaConf.to_container(cfg.model)
    m.pop("lora", None)
    return _parts(json.dumps(m, sort_keys=True, default=str))


def _layers(cfg: DictConfig) -> int:
    return int(getattr(hf.auto_config(cfg.model), "num_hidden_layers", 0) or 0)


def _heads(cfg: DictConfig) -> int | None:
    return heads_of(hf.auto_config(cfg.model))[0] or None


FAMILY = ModelFamily(
    name="hf_causal_lm", options=("hf_causal_lm",), schema=HFCausalLMModelConfig, check=check, spec=spec,
    build="loom.models.hf.module:build", shapes=shapes, normalize=normalize,
    summary="any transformers decoder (AutoModelForCausalLM) from a local config.json, and its weights",
    splits_note="tensor and pipeline, by its architecture's own base_model_tp_plan / base_model_pp_plan",
    split_problem=split_problem, layers=_layers, heads=_heads,
    keys={"layers": "model.overrides.num_hidden_layers", "heads": "model.overrides.num_attention_heads",
          "kv_heads": "model.overrides.num_key_value_heads"},
    vocab=lambda cfg: int(hf.config_dict(cfg.model).get("vocab_size") or 0),
    width=lambda cfg: int(getattr(hf.auto_config(cfg.model), "hidden_size", 0) or 0),
    hf_config=lambda cfg: hf_checks.export_config(cfg), largest=largest, parts=parts,
    built_on_host=lambda cfg: hf.loads_whole(cfg.model), zero3_problem=lambda cfg: hf.zero3_problem(cfg.model),
    lora_targets=lora_targets, weights_dir=weights_dir, packages=("transformers",),
    context_parallel=hf_checks.context_problem, kv_heads=lambda cfg: heads_of(hf.auto_config(cfg.model))[1] or None)
