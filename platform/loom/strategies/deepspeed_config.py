"""The DeepSpeed JSON a ZeRO run uses: Loom's values merged over the user's file.

A Hugging Face-style JSON drops in: `"auto"` means "Loom fills it in" for every key Loom owns
or derives (batch sizes from the parallel layout, clipping, precision, offload, the optimizer
and scheduler params from `optim`, ZeRO bucket sizes from the model width); any other value
must agree with the run config. The file is first checked against DeepSpeed's own key set and
types (`deepspeed_check`, torch-free), and every problem, of any kind, is reported in one
ConfigError (exit 2). Torch-free: it runs during validation and is written to plan.json.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.layout import ParallelLayout
from loom.strategies import deepspeed_keys
from loom.strategies.deepspeed_check import AUTO, schema_problems
from loom.strategies.deepspeed_optim import optimizer_block, scheduler_block
from loom.strategies.schema import ZERO_STAGES


def zero_stage(name: str) -> int | None:
    """The ZeRO stage of a strategy option, None for strategies that are not DeepSpeed."""
    return ZERO_STAGES.get(name)


def _deepspeed_json(path: str) -> dict:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r}: no such file "
            f"(resolved to {p.resolve()}). Pass the path to a DeepSpeed JSON config, or null for Loom's."
        )
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r} is not valid JSON ({e}). "
            "Fix the file or pass null for Loom's DeepSpeed config."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r} must hold a JSON object "
            f"(got {type(data).__name__})."
        )
    return data


_MISSING = object()


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(d.get(part), dict):
            d[part] = {}
        d = d[part]
    d[leaf] = value


# Filled in when the user's JSON leaves them out (a user may override them). With bf16 DeepSpeed
# otherwise reduces and accumulates gradients in bf16 (`communication_data_type` and
# `grad_accum_dtype` default to the model's dtype), and a config dict given to Lightning skips
# Lightning's own `overlap_comm: true` (ZeRO-3 has it on already; 1 and 2 default it off). In
# fp32 runs both dtypes are what DeepSpeed uses anyway. bf16 + fp32 accumulation at stage 1
# makes DeepSpeed use its BF16_Optimizer (still one fp32 partition per rank).
PRECISION_DEFAULTS: dict[str, Any] = {
    "zero_optimization.overlap_comm": True,
    "communication_data_type": "fp32",
    "data_types.grad_accum_dtype": "fp32",
}


@dataclass
class Owned:
    """A key Loom decides: its value and the config key it comes from. `set_if_absent=False`:
    only checked (a JSON that leaves it out already means the same)."""

    value: Any
    source: str
    set_if_absent: bool = True


def _owned(cfg: DictConfig, layout: ParallelLayout) -> dict[str, Owned]:
    """Every key Loom owns, from the run config and the parallel layout."""
    s, hw, tr = cfg.strategy, cfg.hardware, cfg.trainer
    prec, micro, accum = hw.precision, cfg.dataset.batch_size, tr.accumulate_grad_batches
    clip = float(tr.gradient_clip_val or 0.0)
    out = {
        "train_micro_batch_size_per_gpu": Owned(micro, f"dataset.batch_size={micro}"),
        "gradient_accumulation_steps": Owned(accum, f"trainer.accumulate_grad_batches={accum}"),
        "train_batch_size": Owned(layout.global_batch(micro, accum),
                                  f"dataset.batch_size={micro} x trainer.accumulate_grad_batches={accum} "
                                  f"x {layout.dp} data-parallel ranks"),
        "zero_optimization.stage": Owned(zero_stage(s.name), f"strategy={s.name}"),
        "bf16.enabled": Owned(prec in ("bf16-mixed", "bf16-true"), f"hardware.precision={prec}"),
        "fp16.enabled": Owned(prec in ("16-mixed", "16-true"), f"hardware.precision={prec}"),
        "gradient_clipping": Owned(clip, f"trainer.gradient_clip_val={tr.gradient_clip_val}"),
    }
    opt_src = f"strategy.offload_optimizer={str(s.offload_optimizer).lower()}"
    par_src = f"strategy.offload_params={str(s.offload_params).lower()}"
    out["zero_optimization.offload_optimizer.device"] = Owned("cpu" if s.offload_optimizer else "none", opt_src,
                                                              set_if_absent=bool(s.offload_optimizer))
    out["zero_optimization.offload_param.device"] = Owned("cpu" if s.offload_params else "none", par_src,
                                                          set_if_absent=bool(s.offload_params))
    if s.offload_optimizer:  # the run's own torch AdamW steps on the host (conf/strategy/zero3_offload.yaml)
        out["zero_force_ds_cpu_optimizer"] = Owned(False, f"{opt_src} (Loom's torch optimizer on the host)")
    return out


def _derived(cfg: DictConfig, user: dict) -> dict[str, int]:
    """What each `"auto"` ZeRO size of the JSON becomes, from the model width as Hugging Face
    derives it (hidden^2, 0.9 hidden^2, 10 hidden). An unknown width (a custom model) leaves
    them to DeepSpeed's defaults."""
    sizes = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    autos = [k for k in sizes if _get(user, f"zero_optimization.{k}") == AUTO]
    if not autos:
        return {}
    from loom.models import model_spec

    hidden = int(model_spec(cfg).width or 0)
    return {f"zero_optimization.{k}": sizes[k](hidden) for k in autos} if hidden else {}


@dataclass
class Resolved:
    config: dict
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def resolve_deepspeed(cfg: DictConfig, layout: ParallelLayout) -> Resolved:
    """The resolved config, with every problem of the user's JSON (none: it may run) and the
    warnings `loom plan` prints."""
    s, hw = cfg.strategy, cfg.hardware
    user = _deepspeed_json(s.deepspeed_config) if s.deepspeed_config else {}
    res = Resolved(copy.deepcopy(user), schema_problems(user))
    out = res.config
    for key, own in _owned(cfg, layout).items():
        theirs = _get(user, key)
        if theirs is _MISSING:
            if own.set_if_absent:
                _set(out, key, own.value)
        elif theirs == AUTO or _same(theirs, own.value):
            _set(out, key, own.value)
        else:
            name = own.source.split("=")[0].split(" ")[0]
            res.problems.append(f"{key}={theirs!r}, but Loom sets {key}={own.value!r} from {own.source}: "
                                f"set it to \"auto\" (or remove it) or change {name}")
    for key, value in _derived(cfg, user).items():
        _set(out, key, value)
    if "optimizer" in user:
        _replace(out, "optimizer", optimizer_block(user["optimizer"], cfg, _same, res.problems))
    if "scheduler" in user:
        _replace(out, "scheduler", scheduler_block(user["scheduler"], cfg, _same, res.problems, res.warnings))
    _drop_auto(out)
    defaults: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,  # torch's AdamW, from optim/; ZeRO handles it
        "steps_per_print": 10**9,              # Loom logs; keep DeepSpeed's console quiet
        "wall_clock_breakdown": False,
        **PRECISION_DEFAULTS,
    }
    if s.offload_optimizer:
        defaults["zero_optimization.offload_optimizer.pin_memory"] = hw.accelerator == "gpu"
    if s.offload_params:
        defaults["zero_optimization.offload_param.pin_memory"] = hw.accelerator == "gpu"
    for key, value in defaults.items():
        if _get(out, key) is _MISSING:
            _set(out, key, value)
    return res


def _replace(out: dict, key: str, block: dict | None) -> None:
    if block is None:
        out.pop(key, None)
    else:
        out[key] = block


def _drop_auto(out: dict) -> None:
    """`"auto"` left on a key Loom does not own means DeepSpeed's default: DeepSpeed's models drop
    such values themselves; a top-level scalar would reach DeepSpeed as the string "auto"."""
    for key in [k for k, v in out.items() if v == AUTO]:
        out.pop(key)
    for section in deepspeed_keys.SECTIONS:
        node = _get(out, section)
        if isinstance(node, dict):
            _drop_auto_in(node)


def _drop_auto_in(node: dict) -> None:
    for key in [k for k, v in node.items() if v == AUTO]:
        node.pop(key)
    for v in node.values():
        if isinstance(v, dict):
            _drop_auto_in(v)


def resolved_deepspeed_config(cfg: DictConfig, layout: ParallelLayout) -> dict:
    """The DeepSpeed config this run uses (plan.json's `deepspeed_config`); a ConfigError listing
    every problem of the user's JSON at once."""
    res = resolve_deepspeed(cfg, layout)
    if res.problems:
        n = len(res.problems)
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={cfg.strategy.deepspeed_config!r}: "
            f"{n} problem{'s' if n > 1 else ''} (DeepSpeed {deepspeed_keys.DEEPSPEED_VERSION}'s keys; "
            "\"auto\" lets Loom fill a value in from the run config):\n"
            + "\n".join(f"  - {p}" for p in res.problems)
        )
    return res.config


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b
