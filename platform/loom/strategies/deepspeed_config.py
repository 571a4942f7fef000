"""The DeepSpeed JSON a ZeRO run uses: Loom's values merged over the user's file.

Torch-free: it runs during validation (a conflict is exit 2) and is written to plan.json.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
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


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[leaf] = value


_MISSING = object()

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


def resolved_deepspeed_config(cfg: DictConfig) -> dict:
    """The DeepSpeed config this run uses: Loom's values merged over the user's JSON.

    Loom sets the batch, accumulation, ZeRO stage, precision, clipping and offload keys from
    the run config; a user JSON (`strategy.deepspeed_config`) may add anything else, but a key
    Loom sets with a different value is a ConfigError naming both values and their sources.
    Defaults (`PRECISION_DEFAULTS`, DeepSpeed's console) fill only keys the JSON leaves out.
    No torch import: this runs during validation (exit 2) and is written to plan.json.
    """
    s, hw, tr = cfg.strategy, cfg.hardware, cfg.trainer
    stage = zero_stage(s.name)
    prec = hw.precision
    clip = float(tr.gradient_clip_val or 0.0)
    ours: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (cfg.dataset.batch_size, f"dataset.batch_size={cfg.dataset.batch_size}"),
        "gradient_accumulation_steps": (tr.accumulate_grad_batches,
                                        f"trainer.accumulate_grad_batches={tr.accumulate_grad_batches}"),
        "zero_optimization.stage": (stage, f"strategy={s.name}"),
        "bf16.enabled": (prec in ("bf16-mixed", "bf16-true"), f"hardware.precision={prec}"),
        "fp16.enabled": (prec in ("16-mixed", "16-true"), f"hardware.precision={prec}"),
        "gradient_clipping": (clip, f"trainer.gradient_clip_val={tr.gradient_clip_val}"),
    }
    if s.offload_optimizer:
        ours["zero_optimization.offload_optimizer.device"] = ("cpu", "strategy.offload_optimizer=true")
        # The run's own torch AdamW steps on the host (see conf/strategy/zero3_offload.yaml).
        ours["zero_force_ds_cpu_optimizer"] = (False, "strategy.offload_optimizer=true (torch AdamW)")
    if s.offload_params:
        ours["zero_optimization.offload_param.device"] = ("cpu", "strategy.offload_params=true")
    defaults: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,  # torch's AdamW, from optim/; ZeRO handles it
        "steps_per_print": 10**9,              # Loom logs; keep DeepSpeed's console quiet
        "wall_clock_breakdown": False,
        **PRECISION_DEFAULTS,
    }
    if s.offload_optimizer:
        defaults["zero_optimization.offload_optimizer.pin_memory"] = hw.accelerator == "gpu"
    user: dict = {}
    if s.deepspeed_config:
        user = _deepspeed_json(s.deepspeed_config)
    out = copy.deepcopy(user)
    for key, (value, source) in ours.items():
        theirs = _get(user, key)
        if theirs is not _MISSING and not _same(theirs, value):
            raise ConfigError(
                f"Invalid config: strategy.deepspeed_config={s.deepspeed_config!r} sets {key}={theirs!r}, "
                f"but Loom sets {key}={value!r} from {source}. Remove {key} from the JSON "
                f"(Loom fills it in) or change {source.split(' ')[0].split('=')[0]} to match."
            )
        _set(out, key, value)
    for key, value in defaults.items():
        if _get(out, key) is _MISSING:
            _set(out, key, value)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b
