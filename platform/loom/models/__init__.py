"""Models as config groups (conf/model/): one folder per model family (`gpt/`, `llama/`, `hf/`),
an MLP classifier and your own module (`model=custom`). The rest of Loom asks these functions,
which ask the option's family (loom.models.registry): never a family's names or config keys.

This package's top level stays free of torch (schemas, checks and `model_spec` run in the
launcher); `build_module` imports torch and Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.data import items_per_sample
from loom.errors import fail
from loom.layout import ParallelLayout
from loom.models import checks, init_from, lora_checks
from loom.models.heads import head_of
from loom.models.registry import FAMILIES, MODELS
from loom.models.spec import ModelSpec, Parts
from loom.packages import Need
from loom.schema import load

SCHEMAS: dict[str, type] = {name: option.schema for name, option in MODELS.items()}

# This group's rows of loom.packages' table: a family's own packages, and LoRA's (peft).
NEEDS: tuple[Need, ...] = (
    *(Need(f"model={' or '.join(f.options)}", lambda cfg, f=f: cfg.model.name in f.options, module,
           example=(f"model={f.options[0]}",)) for f in FAMILIES for module in f.packages),
    Need("model.lora.r > 0", lambda cfg: lora_checks.lora_on(cfg.model), "peft",
         example=(f"model={next(f.options[0] for f in FAMILIES if f.lora_targets)}", "model.lora.r=8")),
)


def model_spec(cfg: DictConfig) -> ModelSpec:
    """Parameter count and training FLOPs per item of the configured model. With LoRA the frozen
    weights get no gradient: of their 6 FLOPs per weight per token (forward 2, backward 4) the 2
    of the weight gradient are not done, and each adapter weight costs the usual 6, so MFU counts
    the work the step does: 6N - 2N + 6 * adapters (+ attention). The items per sample are the
    data's to say (loom.data.items_per_sample: a preference pair is two sequences)."""
    spec = dataclasses.replace(MODELS[cfg.model.name].spec(cfg), items_per_sample=items_per_sample(cfg))
    adapters = trainable_params(cfg)
    if adapters is None or spec.flops_per_token is None or spec.matmul_params is None:
        return spec
    flops = spec.flops_per_token - 2 * spec.matmul_params + 6 * adapters
    return dataclasses.replace(spec, flops_per_token=float(flops))


def experiment_of(cfg: DictConfig) -> str:
    """The run's experiment name: `experiment` when given, else its model's family without its
    wildcard (gpt, llama, moe, hf_causal_lm, mlp, custom), so runs of one family sit side by side
    under runs/<family>/ (every run was under runs/gpt/, Llama, MoE and Kubernetes runs too)."""
    given = cfg.get("experiment")
    if given:
        return str(given)
    family = MODELS.get(str(OmegaConf.select(cfg, "model.name", default="")))
    return family.name.rstrip("*_") if family is not None else "custom"


def normalize(cfg: DictConfig) -> None:
    MODELS[cfg.model.name].normalize(cfg)
    init_from.normalize(cfg)
    cfg.experiment = experiment_of(cfg)


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    option = MODELS[cfg.model.name]
    option.check(cfg, layout)
    checks.check_packing(cfg, layout, option.document_masks, document_maskers())
    init_from.check(cfg, option, list(FAMILIES))  # the source's tensors against the model's, before launch
    lora_checks.check(cfg, layout, option.lora_targets, " and ".join(f.name for f in FAMILIES if f.lora_targets))
    _check_export_format(cfg)


def _check_export_format(cfg: DictConfig) -> None:
    """checkpoint.export_format=hf needs a transformers architecture that holds this model."""
    if cfg.checkpoint.get("export_format", "loom") != "hf" or MODELS[cfg.model.name].hf_config is not None:
        return
    able = ", ".join(f.name for f in FAMILIES if f.hf_config is not None)
    fail("checkpoint.export_format", "hf",
         f"model={cfg.model.name} has no Hugging Face architecture to export to (models that have one: "
         f"{able}); keep checkpoint.export_format=loom (final/model.safetensors)")


def trainable_params(cfg: DictConfig) -> int | None:
    """Parameters the optimizer updates when fewer than all: LoRA's adapters, r x (in + out) per
    wrapped Linear (models.lora_checks), and a score head's own weights; None when every parameter trains."""
    option = MODELS[cfg.model.name]
    if not lora_checks.lora_on(cfg.get("model")) or option.lora_targets is None:
        return None
    head = head_of(cfg.model).own_params(model_width(cfg))  # a reward model's score head trains too
    return lora_checks.adapter_params(cfg, option.lora_targets(cfg)) + head


def module_classes(cfg: DictConfig) -> tuple[str, ...]:
    """The model's module class names (strategy.shard_units' choices); empty: not known before torch."""
    return MODELS[cfg.model.name].module_classes


def attention_heads(cfg: DictConfig) -> int | None:
    """The attention heads a tensor-parallel rank holds whole parts of (None: not known here)."""
    return MODELS[cfg.model.name].heads(cfg)


def kv_heads(cfg: DictConfig) -> int | None:
    """The key/value heads (grouped-query attention; None: as many as the attention heads, or unknown)."""
    return MODELS[cfg.model.name].kv_heads(cfg) or attention_heads(cfg)


def context_problem(cfg: DictConfig) -> str | None:
    """Why `cfg.model` cannot split its sequences over context-parallel ranks (None: it can)."""
    problem = MODELS[cfg.model.name].context_parallel
    if problem is None:
        able = ", ".join(f.name for f in FAMILIES if f.context_parallel is not None)
        return f"its attention is not Loom's to split (the families that split it: {able})"
    return problem(cfg)


def model_parts(cfg: DictConfig) -> Parts | None:
    """Where the model's parameters sit by layer (None: not a layered decoder Loom splits)."""
    parts = MODELS[cfg.model.name].parts
    return parts(cfg) if parts is not None else None


def hf_export_config(cfg: DictConfig) -> dict[str, Any]:
    """config.json of `checkpoint.export_format=hf` for the run's model (validated: it has one)."""
    return dict(MODELS[cfg.model.name].hf_config(cfg))


def key_notes() -> dict[str, str]:
    """What a model.* key some families have means for the others (appended to an unknown-key refusal)."""
    lora = " and ".join(f"model={f.name}" for f in FAMILIES if f.lora_targets)
    return {"model.lora": f"model.lora (LoRA adapters) is for {lora}: the other families have no separate "
                          "q/k/v projections for adapters to wrap"}


def split_problem(cfg: DictConfig, how: str) -> str | None:
    """Why `cfg.model` cannot be split `how` ("tensor_parallel" | "pipeline"), None when it can:
    its family's answer, so strategies' checks ask the model instead of recognizing names."""
    problem = MODELS[cfg.model.name].split_problem
    if problem is None:
        return f"model={cfg.model.name} has no {how.replace('_', '-')} split"
    return problem(cfg, how)


def splits(cfg: DictConfig, how: str) -> bool:
    return split_problem(cfg, how) is None


def splittable(how: str) -> str:
    """The model families that can be split `how` (some members may not be), for refusals."""
    return ", ".join(f.name for f in FAMILIES if f.split_problem is not None)


def document_maskers() -> str:
    """The families whose forward masks attention per document, for refusals."""
    return ", ".join(f.name for f in FAMILIES if f.document_masks)


def model_width(cfg: DictConfig) -> int:
    """The hidden size of `cfg.model` (activations a layer passes on); 0: not a decoder."""
    return MODELS[cfg.model.name].width(cfg)


def vocab_size(cfg: DictConfig) -> int:
    """The model's vocabulary (logits per token); 0: not a language model."""
    return MODELS[cfg.model.name].vocab(cfg)


def expert_count(cfg: DictConfig) -> int:
    """Routed experts per layer of a mixture of experts (0: not one): what strategy.ep splits."""
    return MODELS[cfg.model.name].experts(cfg)


def experts_per_token(cfg: DictConfig) -> int:
    """How many experts each token is routed to (the router's top-k; 0: not a mixture of experts)."""
    return MODELS[cfg.model.name].experts_per_token(cfg)


def expert_param_count(cfg: DictConfig) -> int:
    """All routed experts' parameters (0: not a mixture of experts)."""
    return MODELS[cfg.model.name].expert_params(cfg)


def model_key(cfg: DictConfig, what: str) -> str:
    """The key a user sets for the model's `what` ("layers" | "heads"), for refusals."""
    return MODELS[cfg.model.name].keys.get(what, f"the model's {what}")


def layer_count(cfg: DictConfig) -> int:
    """The decoder layers of `cfg.model` (pipeline stages hold whole ones); 0: not a decoder."""
    return MODELS[cfg.model.name].layers(cfg)


def family_table() -> str:
    """docs/models.md's table of model families (tests/test_model_families.py holds the page to it)."""
    rows = ["| family | options | what it is | split beyond data parallelism | LoRA | export to transformers |",
            "|---|---|---|---|---|---|"]
    for f in FAMILIES:
        splits_how = "no" if f.split_problem is None else f.splits_note or "tensor and pipeline"
        rows.append(f"| {f.name} | {', '.join(f.options)} | {f.summary} | {splits_how} | "
                    f"{'yes' if f.lora_targets else 'no'} | {'yes' if f.hf_config else 'no'} |")
    return "\n".join(rows)


def build_module(cfg: DictConfig) -> Any:
    """The run's LightningModule, built from the frozen config (seeded by the caller)."""
    return load(MODELS[cfg.model.name].build)(cfg)
