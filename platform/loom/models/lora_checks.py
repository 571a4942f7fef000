"""`model.lora` in the launcher: is it on, can this run train it, which modules does it wrap, and
how many parameters do the adapters add (the plan's trainable count).

Torch-free for Loom's Llama family (its Linear modules are written out from the config); for
`hf_causal_lm` the module names come from the architecture built on the meta device, the same
build its other checks already make (transformers imports torch), once per model config.

A target matches a module as peft's list form matches it (`check_target_module_exists`): the
module's name equals it or ends with `.<target>`. peft refuses only when no target matches at
all; here every target must name at least one Linear module, so a misspelled entry beside good
ones is not silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from loom.errors import fail, require
from loom.layout import ParallelLayout
from loom.models.schema import LORA_TARGETS

# module name -> (in_features, out_features) of each Linear a LoRA adapter can wrap
Targets = dict[str, tuple[int, int]]
MAX_LISTED = 12  # module names listed in a refusal


def lora_on(m: DictConfig | None) -> bool:
    """Whether `cfg.model` trains LoRA adapters (`model.lora.r` > 0; r=0 or no lora node: off)."""
    lora = m.get("lora") if isinstance(m, DictConfig) else None
    return bool(lora) and int(lora.get("r") or 0) > 0


def matches(module: str, target: str) -> bool:
    """peft's rule for a list of target names: the whole name, or its last dotted parts."""
    return module == target or module.endswith(f".{target}")


def adapted(cfg: DictConfig, targets: Targets) -> Targets:
    """The modules `model.lora.target_modules` selects, of `targets` (the model's Linear modules)."""
    wanted = list(cfg.model.lora.target_modules)
    return {name: io for name, io in targets.items() if any(matches(name, t) for t in wanted)}


def adapter_params(cfg: DictConfig, targets: Targets) -> int:
    """Parameters the adapters add: r x (in + out) per wrapped Linear (lora_A: r x in, lora_B: out x r)."""
    r = int(cfg.model.lora.r)
    return sum(r * (i + o) for i, o in adapted(cfg, targets).values())


def _short(names: list[str]) -> str:
    """Distinct last name parts (q_proj, lm_head, ...), in order."""
    parts = list(dict.fromkeys(n.rpartition(".")[2] for n in names))
    more = f" (and {len(parts) - MAX_LISTED} more)" if len(parts) > MAX_LISTED else ""
    return ", ".join(parts[:MAX_LISTED]) + more


def check(cfg: DictConfig, layout: ParallelLayout, targets: Callable[[DictConfig], Targets] | None,
          families: str) -> None:
    """Refuse (exit 2) adapters this run cannot train: the family (`targets` None: no LoRA for it;
    `families`: the options that have it), r / alpha / dropout, tensor or pipeline parallelism,
    and target_modules naming no Linear module of the model."""
    m = cfg.model
    lora = m.get("lora")
    if not lora_on(m):
        require(lora is None or int(lora.r) == 0, "model.lora.r", None if lora is None else lora.r,
                "must be >= 0 (0: no LoRA; e.g. model.lora.r=16 model.lora.alpha=32)")
        return
    require(targets is not None, "model.lora.r", lora.r,
            f"model={m.name} has no LoRA support; LoRA is for model={families}")
    require(float(lora.alpha) > 0, "model.lora.alpha", lora.alpha, "must be > 0 (the update is scaled by alpha / r)")
    require(0.0 <= float(lora.dropout) < 1.0, "model.lora.dropout", lora.dropout, "must be in [0, 1)")
    require(len(lora.target_modules) > 0, "model.lora.target_modules", list(lora.target_modules),
            f"must name at least one Linear module, e.g. [{', '.join(LORA_TARGETS)}]")
    _check_layout(cfg, layout)
    linear = targets(cfg)
    for t in lora.target_modules:
        if not any(matches(name, str(t)) for name in linear):
            fail("model.lora.target_modules", list(lora.target_modules),
                 f"{t!r} names no Linear module of model={m.name} (a target matches a module whose name is "
                 f"it or ends with .<target>); the model's Linear modules: {_short(list(linear))}")


def _check_layout(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Data parallelism only: single, ddp, fsdp and zero1-3 (zero3_offload too)."""
    s = cfg.strategy
    valid = "valid strategies with model.lora: single, ddp, fsdp, zero1, zero2, zero3, zero3_offload"
    require(layout.tp <= 1, "strategy.name", s.name,
            f"tensor parallelism (tp={layout.tp}) splits q/k/v/o/gate/up/down, the Linear modules LoRA "
            f"wraps, and peft's adapters are not tensor-parallel; {valid}")
    require(layout.pp <= 1, "strategy.name", s.name,
            f"pipeline stages (pp={layout.pp}) with LoRA adapters are not supported; {valid}")
