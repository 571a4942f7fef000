"""One registry of the model options: schema, checks, arithmetic and how each is built.

Adding a model = a yaml in conf/model/, a schema in `schema.py` (or an existing one), its
checks in `checks.py`, its parameter/FLOP arithmetic in `spec.py`, a builder in `build.py`,
and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models import checks, hf, init_from, llama_hf, lora_checks, spec
from loom.models.schema import (
    GPT_SIZES,
    LLAMA_OPTIONS,
    CustomModelConfig,
    GPTModelConfig,
    HFCausalLMModelConfig,
    LlamaModelConfig,
    MLPModelConfig,
)
from loom.models.spec import ModelSpec
from loom.schema import nothing_to_fill


@dataclass(frozen=True)
class ModelOption:
    schema: type
    check: Callable[[DictConfig, ParallelLayout], None]
    spec: Callable[[DictConfig], ModelSpec]
    build: str        # "loom.models.build:function" (cfg) -> LightningModule; imports torch
    # its state dict's names and shapes (model.init_from is checked against them before launch)
    shapes: Callable[[DictConfig], init_from.Shapes]
    normalize: Callable[[DictConfig], None] = nothing_to_fill
    # Whether Loom's code can split the model over ranks beyond data parallelism, for validation
    # (torch-free); the how is the worker's: the LightningModule's `tensor_parallel_plan`, the
    # network's `pipeline_split` (models.pipeline_split). `family` names the options in refusals.
    tensor_parallel: bool = False
    pipeline: bool = False
    family: str = ""
    # config.json of `checkpoint.export_format=hf` (torch-free; None: no transformers architecture
    # holds this model, so that export is refused at validation)
    hf_config: Callable[[DictConfig], dict] | None = None
    # where a layered decoder's parameters sit (the plan's pipeline stages and TP); None: not one
    parts: Callable[[DictConfig], spec.Parts] | None = None
    # elements of its largest parameter (initialization materializes one whole, in fp32; the plan's
    # build memory); 0: unknown. Whether it is built whole on the host instead of on meta.
    largest: Callable[[DictConfig], float] = lambda cfg: 0.0
    built_on_host: Callable[[DictConfig], bool] = lambda cfg: False
    # (the model.* key, why ZeRO-3 cannot start it), None when it can: the zero* check asks
    zero3_problem: Callable[[DictConfig], tuple[str, str] | None] = lambda cfg: None
    # whether its forward takes per-document positions and masks attention to each document
    # (`dataset.packing=documents`, loom.models.document_mask); checks.check_packing refuses the rest
    document_masks: bool = False
    # the Linear modules LoRA adapters can wrap, name -> (in, out) (`model.lora`, models.lora_checks);
    # None: the family has no LoRA (GPT: one fused qkv Linear, not q/k/v modules to adapt)
    lora_targets: Callable[[DictConfig], lora_checks.Targets] | None = None
    # its module class names (torch-free: the choices of strategy.shard_units; empty: not checked)
    # and the attention heads each tensor-parallel rank must hold whole (None: not known here)
    module_classes: tuple[str, ...] = ()
    heads: Callable[[DictConfig], int | None] = lambda cfg: None


_GPT = ModelOption(GPTModelConfig, checks.check_gpt, spec.gpt_spec_of, "loom.models.build:gpt",
                   lambda cfg: init_from.gpt_shapes(cfg.model), normalize=checks.size_vocab_to_tokenizer,
                   tensor_parallel=True, pipeline=True, family="gpt_*", parts=lambda cfg: spec.gpt_parts(cfg.model),
                   largest=lambda cfg: float(spec.gpt_parts(cfg.model).largest), document_masks=True,
                   module_classes=checks.GPT_MODULE_CLASSES, heads=lambda cfg: int(cfg.model.n_head))
_LLAMA = ModelOption(LlamaModelConfig, checks.check_llama, spec.llama_spec_of, "loom.models.build:llama",
                     lambda cfg: llama_hf.llama_shapes(cfg.model), normalize=checks.normalize_llama,
                     tensor_parallel=True, pipeline=True, family="llama*",
                     hf_config=lambda cfg: llama_hf.config_from_fields(cfg.model),
                     parts=lambda cfg: spec.llama_parts(cfg.model),
                     largest=lambda cfg: float(spec.llama_parts(cfg.model).largest), document_masks=True,
                     lora_targets=lora_checks.llama_targets, module_classes=llama_hf.MODULE_CLASSES,
                     heads=lambda cfg: int(cfg.model.n_head))

MODELS: dict[str, ModelOption] = {
    **{size: _GPT for size in GPT_SIZES},
    **{option: _LLAMA for option in LLAMA_OPTIONS},
    "mlp": ModelOption(MLPModelConfig, checks.check_mlp, spec.mlp_spec, "loom.models.build:mlp",
                       lambda cfg: init_from.mlp_shapes(cfg.model), normalize=checks.normalize_mlp,
                       largest=spec.mlp_largest),
    "hf_causal_lm": ModelOption(HFCausalLMModelConfig, checks.check_hf, spec.hf_spec, "loom.models.build:hf",
                                init_from.hf_shapes, normalize=checks.normalize_hf,
                                hf_config=lambda cfg: hf.config_dict(cfg.model), largest=spec.hf_largest,
                                built_on_host=lambda cfg: hf.loads_whole(cfg.model),
                                zero3_problem=lambda cfg: hf.zero3_problem(cfg.model),
                                lora_targets=lora_checks.hf_targets),
    "custom": ModelOption(CustomModelConfig, checks.check_custom, spec.custom_spec, "loom.models.build:custom",
                          init_from.custom_shapes, normalize=checks.normalize_custom,
                          built_on_host=lambda cfg: True),  # its own __init__ allocates
}
