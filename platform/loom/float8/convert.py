"""float8's torch half (imported only in the worker): the model's Linear layers swapped for torchao's
float8 training layers, on the meta model, before tensor parallel / FSDP2 wrap it (torchtitan's order).

tensorwise / rowwise / rowwise_with_gw_hp: `convert_to_float8_training` with the recipe's
`Float8LinearConfig` (`Float8Linear` keeps the `weight` and `bias` parameters of the Linear it
replaces, the same tensors under the same names: name-seeded init, checkpoints, final weights and
init_from are unchanged). mxfp8: torchao's MX training path (`quantize_` with
`MXFP8TrainingOpConfig`), whose weight parameter wraps the same values in a tensor subclass.

What stays in high precision, and why (`Float8Conversion.skipped`): a name ending with one of
`float8.skip` (the output head: its logits feed the loss directly); any dimension not divisible by
16 (32 for mxfp8, the MX block), which the float8 kernels need; under mxfp8 a layer with a bias
(torchao 0.18's MX `linear` override drops it); with `float8.auto_filter`, the shapes too small to
gain (`_auto_filter_for_recipe`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from loom.float8.rules import emulates
from loom.float8.schema import RECIPES

log = logging.getLogger("loom")

LAYERS_LISTED = 64  # summary.json's converted_layers: the first this many names (the count is always whole)


def auto_filter(recipe: str):
    """Torchtitan's `auto_filter_small_kn`: torchao's `_auto_filter_for_recipe` (True: convert)
    for tensorwise and rowwise. torchao raises for rowwise_with_gw_hp and has no rule for mxfp8:
    rowwise_with_gw_hp takes rowwise's rule (the same float8 forward and input gradient; its
    weight gradient stays in high precision, so a shape too small for rowwise gains even less);
    mxfp8 keeps every shape (no H100-measured thresholds exist for it: None)."""
    from torchao.float8 import _auto_filter_for_recipe

    if recipe == "mxfp8":
        return None
    return _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])


class Float8Conversion:
    """One run's conversion: `convert` (construct, once per rank), `after_optimizer_step` (FSDP2
    float8 all-gather's scales) and `summary_fields` (summary.json `float8`)."""

    def __init__(self, cfg: DictConfig) -> None:
        node = cfg.float8
        self.recipe = str(RECIPES[str(node.name)])
        self.skip = tuple(str(s) for s in (node.get("skip") or ()))
        self.use_auto_filter = bool(node.get("auto_filter", True))
        self.emulate_cfg = node.get("emulate")
        self.all_gather_cfg = bool(node.get("all_gather", False))
        self.emulated: bool | None = None
        self.all_gather = False
        self.converted: list[str] = []
        self.skipped: dict[str, str] = {}

    def why_skipped(self, name: str, linear: nn.Linear, small) -> str | None:
        """Why `linear` (module name `name`) stays in high precision, or None to convert it."""
        if any(name == s or name.endswith("." + s) for s in self.skip):
            return "float8.skip"
        multiple = 32 if self.recipe == "mxfp8" else 16
        if linear.in_features % multiple or linear.out_features % multiple:
            return (f"in/out features {linear.in_features}x{linear.out_features} "
                    f"not divisible by {multiple}")
        if self.recipe == "mxfp8" and linear.bias is not None:
            return "bias (torchao's MX linear drops it)"
        if small is not None and not small(linear, name):
            return "auto_filter: too small to gain"
        return None

    def convert(self, model: nn.Module, device: torch.device, fsdp2: bool) -> None:
        """Swap `model`'s eligible Linear layers in place (the model may be on the meta device)."""
        self.emulated = emulates(self.emulate_cfg, on_gpu=device.type == "cuda")
        self.all_gather = self.all_gather_cfg and self.recipe == "tensorwise" and fsdp2
        small = auto_filter(self.recipe) if self.use_auto_filter else None
        chosen: list[str] = []
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name:
                why = self.why_skipped(name, m, small)
                if why is None:
                    chosen.append(name)
                else:
                    self.skipped[name] = why
        wanted = set(chosen)

        def keep(m: nn.Module, fqn: str) -> bool:
            return isinstance(m, nn.Linear) and fqn in wanted

        if self.recipe == "mxfp8":
            _convert_mx(model, keep, self.emulated)
        else:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulated,
                                         enable_fsdp_float8_all_gather=self.all_gather)
            convert_to_float8_training(model, config=config, module_filter_fn=keep)
        self.converted = chosen
        skipped = ", ".join(f"{n} ({why})" for n, why in self.skipped.items()) or "none"
        log.info(f"float8 {self.recipe}{' (emulated)' if self.emulated else ''}"
                 f"{', float8 all-gather' if self.all_gather else ''}: {len(chosen)} Linear layer(s) converted; "
                 f"kept in high precision: {skipped}")

    def after_optimizer_step(self, model: nn.Module) -> None:
        """FSDP2 float8 all-gather: every weight's scale for the next all-gather, computed in one
        all-reduce after the step (torchao's `precompute_float8_dynamic_scale_for_fsdp`)."""
        if self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def summary_fields(self) -> dict[str, Any]:
        return {"float8": {
            "recipe": self.recipe,
            "emulated": self.emulated,
            "all_gather": self.all_gather,
            "converted": len(self.converted),
            "converted_layers": self.converted[:LAYERS_LISTED],
            "skipped": dict(self.skipped),
        }}


def _convert_mx(model: nn.Module, keep, emulated: bool) -> None:
    """torchao's MX training path: each kept Linear's weight wrapped (MXFP8TrainingWeightWrapperTensor),
    its matmul quantized to MXFP8 on the fly; emulated in PyTorch ops off Blackwell."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulated else MXFP8TrainingRecipe.MXFP8_RCEIL
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(recipe), filter_fn=keep)


def converter(cfg: DictConfig) -> Float8Conversion | None:
    """The run's conversion, or None without float8."""
    from loom.float8 import enabled

    return Float8Conversion(cfg) if enabled(cfg) else None
