"""The `optimizer` and `scheduler` blocks of a (Hugging Face-style) DeepSpeed JSON.

Loom builds one optimizer and schedule for every strategy (`loom.optim.build`: torch AdamW or
SGD from `optim`, linear warmup over `optim.warmup_steps`, cosine decay to
`optim.min_lr_ratio x optim.lr` at `trainer.max_steps`), and the plan counts that optimizer's
state. Lightning would instead let DeepSpeed build its own optimizer whenever the config has an
`optimizer` block, silently replacing `optim`. So both blocks are read as a *description* of
Loom's optimizer: `"auto"` is filled from `optim`/`trainer`, any other value must agree with
it (else a conflict, exit 2), and both blocks are then removed from what DeepSpeed gets.
A scheduler type whose shape differs from Loom's schedule is a warning, not a refusal.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

AUTO = "auto"

# DeepSpeed optimizer type (lower case) -> the optim option it describes.
_OPTIMIZER_TYPES = {"adamw": "adamw", "adam": "adamw"}

# DeepSpeed scheduler types that have warmup_num_steps-style params (deepspeed.runtime.lr_schedules).
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _optimizer_values(cfg: DictConfig) -> dict[str, tuple[Any, str]]:
    o = cfg.optim
    if o.name != "adamw":
        return {}
    return {
        "lr": (float(o.lr), f"optim.lr={o.lr}"),
        "betas": ([float(b) for b in o.betas], f"optim.betas={list(o.betas)}"),
        "eps": (float(o.eps), f"optim.eps={o.eps}"),
        "weight_decay": (float(o.weight_decay), f"optim.weight_decay={o.weight_decay}"),
        # DeepSpeed's Adam switches: Loom's torch AdamW is decoupled weight decay, bias-corrected.
        "adam_w_mode": (True, "optim=adamw (decoupled weight decay)"),
        "bias_correction": (True, "optim=adamw (torch AdamW)"),
        "amsgrad": (False, "optim=adamw (torch AdamW, amsgrad off)"),
        "torch_adam": (None, ""),  # an implementation choice: any value describes the same optimizer
    }


def _scheduler_values(cfg: DictConfig) -> dict[str, tuple[Any, str]]:
    o, steps = cfg.optim, cfg.trainer.max_steps
    return {
        "warmup_num_steps": (int(o.warmup_steps), f"optim.warmup_steps={o.warmup_steps}"),
        "total_num_steps": (int(steps), f"trainer.max_steps={steps}"),
        "warmup_max_lr": (float(o.lr), f"optim.lr={o.lr}"),
        "warmup_min_lr": (0.0, "Loom's warmup (from 0 towards optim.lr)"),
        "warmup_min_ratio": (0.0, "Loom's warmup (from 0 towards optim.lr)"),
        "cos_min_ratio": (float(o.min_lr_ratio), f"optim.min_lr_ratio={o.min_lr_ratio}"),
        "warmup_type": ("linear", "Loom's linear warmup"),
        "last_batch_iteration": (None, ""),
    }


def _params(block: dict, where: str, values: dict[str, tuple[Any, str]], same, filled: dict,
            problems: list[str]) -> None:
    params = block.get("params", {})
    if not isinstance(params, dict):
        problems.append(f"{where}.params={params!r}: must be an object")
        return
    for key, theirs in params.items():
        if key not in values:
            problems.append(f"{where}.params.{key}={theirs!r}: Loom's optimizer and schedule have no such "
                            f"parameter; known: {', '.join(k for k in values if values[k][1])}")
            continue
        value, source = values[key]
        if theirs == AUTO or not source:
            filled[key] = value
        elif not same(theirs, value):
            problems.append(f"{where}.params.{key}={theirs!r}, but Loom sets {where}.params.{key}={value!r} "
                            f"from {source}: "
                            f"set it to \"auto\" or change {source.split('=')[0].split(' ')[0]}")
        else:
            filled[key] = value


def optimizer_block(block: Any, cfg: DictConfig, same, problems: list[str]) -> dict | None:
    """The block with "auto" filled from `optim` (what plan.json shows); conflicts appended."""
    if block is None:
        return None
    if not isinstance(block, dict):
        problems.append(f"optimizer={block!r}: must be an object")
        return None
    kind = str(block.get("type", ""))
    described = _OPTIMIZER_TYPES.get(kind.lower())
    if described != cfg.optim.name:
        fix = (f"set optim={described} to match it" if described
               else "change its type to AdamW with optim=adamw (only an AdamW/Adam block describes Loom's optimizer)")
        problems.append(
            f"optimizer.type={kind!r}: Loom builds the optimizer from optim (optim={cfg.optim.name}) under "
            f"every strategy and counts its state in the plan; DeepSpeed's {kind or 'optimizer'} cannot "
            f"replace it. Remove the optimizer block, or {fix}")
        return None
    filled: dict = {}
    _params(block, "optimizer", _optimizer_values(cfg), same, filled, problems)
    return {"type": kind, "params": {k: v for k, v in filled.items() if v is not None}}


def scheduler_block(block: Any, cfg: DictConfig, same, problems: list[str],
                    warnings: list[str]) -> dict | None:
    """The scheduler block with "auto" filled in; a shape unlike Loom's schedule is a warning."""
    if block is None:
        return None
    if not isinstance(block, dict):
        problems.append(f"scheduler={block!r}: must be an object")
        return None
    kind = str(block.get("type", ""))
    if kind not in SCHEDULER_TYPES:
        problems.append(f"scheduler.type={kind!r}: Loom runs its own schedule (linear warmup over "
                        "optim.warmup_steps, cosine decay to optim.min_lr_ratio x optim.lr); a scheduler block "
                        f"may only describe it: {', '.join(SCHEDULER_TYPES)}. Remove the block")
        return None
    filled: dict = {}
    _params(block, "scheduler", _scheduler_values(cfg), same, filled, problems)
    ratio = float(cfg.optim.min_lr_ratio)
    differs = {"WarmupLR": ratio != 1.0, "WarmupDecayLR": True, "WarmupCosineLR": False}[kind]
    if differs:
        warnings.append(
            f"strategy.deepspeed_config: scheduler {kind} is not what runs: Loom's schedule does (linear "
            f"warmup over optim.warmup_steps={cfg.optim.warmup_steps}, then cosine decay to "
            f"optim.min_lr_ratio={ratio} x optim.lr by trainer.max_steps={cfg.trainer.max_steps}; "
            + ("optim.min_lr_ratio=1.0 keeps the rate constant after warmup, as WarmupLR)" if kind == "WarmupLR"
               else "WarmupCosineLR names that shape)"))
    return {"type": kind, "params": {k: v for k, v in filled.items() if v is not None}}
