"""What a model family tells the rest of Loom: the torch-free half of a family (its folder's
`__init__.py` builds one `ModelFamily`; the registry maps each `model=` option to it).

Everything outside a family's folder asks this object, never the family's names, module
classes or config keys: strategies ask `split_problem` and `heads`, the plan `spec`, `parts`,
`largest`, `init_from` asks `shapes` and `init_from_problems`, export asks `hf_config`. The
torch half is named by `build` ("module:function", imported in the worker only): the network,
its LightningModule, init rule, tensor-parallel plan, pipeline split, activation-checkpoint
units and weight adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models.spec import ModelSpec, Parts
from loom.schema import nothing_to_fill

Shapes = dict[str, tuple[int, ...]]
Targets = dict[str, tuple[int, int]]  # a LoRA-able Linear's name -> (in_features, out_features)


@dataclass(frozen=True)
class ModelFamily:
    name: str          # in refusals and docs/models.md's table: "gpt_*", "llama*", "hf_causal_lm"
    options: tuple[str, ...]  # its `model=` options (conf/model/<option>.yaml)
    schema: type
    check: Callable[[DictConfig, ParallelLayout], None]
    spec: Callable[[DictConfig], ModelSpec]
    build: str        # "loom.models.<family>.module:build" (cfg) -> LightningModule; imports torch
    # its state dict's names and shapes (model.init_from is checked against them before launch)
    shapes: Callable[[DictConfig], Shapes]
    summary: str = ""  # one line for docs/models.md's table
    splits_note: str = ""  # the table's word on its tensor/pipeline splits where it is not plain "tensor and pipeline"
    normalize: Callable[[DictConfig], None] = nothing_to_fill
    # Why the configured model cannot be split `how` ("tensor_parallel" | "pipeline"), None when it
    # can (torch-free, at validation); the family's own check refuses what else the split needs
    # (heads, layers, tied embeddings). None for the field: the family has no split of that kind.
    split_problem: Callable[[DictConfig, str], str | None] | None = None
    # decoder layers (pipeline stages hold whole ones) and the attention heads each tensor-parallel
    # rank holds whole parts of (None: not known here)
    layers: Callable[[DictConfig], int] = lambda cfg: 0
    heads: Callable[[DictConfig], int | None] = lambda cfg: None
    width: Callable[[DictConfig], int] = lambda cfg: 0  # hidden size (0: not a decoder)
    # key/value heads (grouped-query attention; None: as many as `heads`): Ulysses context
    # parallelism hands whole ones to each rank
    kv_heads: Callable[[DictConfig], int | None] = lambda cfg: None
    # Why the configured model cannot split its sequences over context-parallel ranks (strategy.cp),
    # None when it can: its attention is Loom's (loom.models.context_parallel). None for the field: no cp.
    context_parallel: Callable[[DictConfig], str | None] | None = None
    # the keys a user sets for the layer and head counts, for refusals: {"layers": "model.n_layer", ...}
    keys: dict[str, str] = field(default_factory=dict)
    vocab: Callable[[DictConfig], int] = lambda cfg: int(cfg.model.get("vocab_size") or 0)
    # config.json of `checkpoint.export_format=hf` (torch-free; None: no transformers architecture
    # holds this model, so that export is refused at validation)
    hf_config: Callable[[DictConfig], dict] | None = None
    # where a layered decoder's parameters sit (the plan's pipeline stages and TP); None: not one
    parts: Callable[[DictConfig], Parts] | None = None
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
    # None: the family has no LoRA
    lora_targets: Callable[[DictConfig], Targets] | None = None
    # its module class names (torch-free: the choices of strategy.shard_units; empty: not checked)
    module_classes: tuple[str, ...] = ()
    # model.init_from: what else is wrong with a source whose tensors `found` (it may drop a tensor
    # it never reads), and its option that reads a Hugging Face dir of config.json `data` (None: none)
    init_from_problems: Callable[[DictConfig, Path, Shapes], list[str]] = lambda cfg, path, found: []
    hf_dir_option: Callable[[dict], str | None] = lambda data: None
    # the Hugging Face directory holding the weights a run started from without model.init_from
    # (what peft merges a LoRA adapter into), or (None, why not); None: it has no such directory
    weights_dir: Callable[[DictConfig], tuple[Path | None, str]] | None = None
    # a mixture of experts: routed experts per layer and all their parameters (what strategy.ep
    # divides); 0: none
    experts: Callable[[DictConfig], int] = lambda cfg: 0
    experts_per_token: Callable[[DictConfig], int] = lambda cfg: 0  # the router's top-k
    expert_params: Callable[[DictConfig], int] = lambda cfg: 0
    # the optional packages (import names, loom.packages.PACKAGES) its options need on any machine
    packages: tuple[str, ...] = ()
