"""A user's DeepSpeed JSON against DeepSpeed's own key set and types, without importing it.

`deepspeed_keys.py` holds the table (generated from DeepSpeed's config code, checked against it
by a test); this module walks a JSON object and lists every unknown, removed or ill-typed key.
`"auto"` is accepted wherever a value may stand: Loom fills it in or leaves DeepSpeed's default
(`strategies.deepspeed_config`), as DeepSpeed's own models drop "auto" values.
"""

from __future__ import annotations

import difflib
from typing import Any

from loom.strategies import deepspeed_keys as K

AUTO = "auto"

# Top-level keys DeepSpeed reads without a model (`get_scalar_param`): the type Loom holds them
# to. Keys of TOP_LEVEL not named here or in SECTIONS accept any value.
SCALARS: dict[str, str] = {
    "train_batch_size": "int:gt=0",
    "train_micro_batch_size_per_gpu": "int:gt=0",
    "gradient_accumulation_steps": "int:gt=0",
    "steps_per_print": "int:gt=0",
    "gradient_clipping": "float:ge=0",
    "gradient_predivide_factor": "float:gt=0",
    "vocabulary_size": "int|null",
    "communication_data_type": "enum:fp32,fp16,bf16|null",
    "seq_parallel_communication_data_type": "enum:fp32,fp16,bf16|null",
    "gradient_allreduce_op": "str",
    "log_level": "str",
    **{k: "bool" for k in ("prescale_gradients", "wall_clock_breakdown", "memory_breakdown",
                           "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                           "disable_allgather", "dump_state", "dataloader_drop_last")},
    **{k: "dict" for k in ("optimizer", "scheduler", "data_types", "checkpoint", "activation_checkpointing",
                           "flops_profiler", "aio", "autotuning", "pipeline", "data_efficiency", "timers",
                           "torch_autocast", "weight_quantization", "expert_parallel")},
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bounds_ok(v: float, bounds: str) -> bool:
    for b in filter(None, bounds.split(",")):
        op, _, x = b.partition("=")
        limit = float(x)
        if not {"ge": v >= limit, "gt": v > limit, "le": v <= limit, "lt": v < limit}[op]:
            return False
    return True


def _matches(v: Any, alt: str) -> bool:
    kind, _, arg = alt.partition(":")
    if kind == "null":
        return v is None
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "int":  # pydantic (lax) takes an integral float too: JSON's 5e8
        return _number(v) and float(v).is_integer() and _bounds_ok(v, arg)
    if kind == "float":
        return _number(v) and _bounds_ok(v, arg)
    if kind == "str":
        return isinstance(v, str)
    if kind == "enum":
        return not isinstance(v, (bool, dict, list)) and str(v) in arg.split(",")
    if kind in ("list", "dict"):
        return isinstance(v, list if kind == "list" else dict)
    if kind == "model":
        return isinstance(v, dict)
    return True  # any


def describe(spec: str) -> str:
    """A type spec in words: `int:ge=0|null` -> `an integer >= 0 or null`."""
    words = []
    for alt in spec.replace(" (deprecated)", "").split("|"):
        kind, _, arg = alt.partition(":")
        if kind == "enum":
            words.append("one of " + ", ".join(arg.split(",")))
            continue
        text = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                "list": "a list", "dict": "an object", "model": "an object", "null": "null"}.get(kind, kind)
        ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        bounds = [f"{ops[b.split('=')[0]]} {b.split('=')[1]}" for b in filter(None, arg.split(","))]
        words.append(" ".join([text, *bounds]) if kind in ("int", "float") else text)
    return " or ".join(words)


def _unknown(path: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{path}: unknown key (DeepSpeed {K.DEEPSPEED_VERSION} reads no such key{hint})"


def _removed(path: str) -> str:
    return f"{path}: removed from DeepSpeed (version {K.DEEPSPEED_VERSION} refuses it); delete it"


def _check_model(obj: dict, model: str, path: str, out: list[str]) -> None:
    fields = K.MODELS[model]
    for key, value in obj.items():
        where = f"{path}.{key}"
        if model == K.SECTIONS["zero_optimization"] and key in K.REMOVED_ZERO:
            out.append(_removed(where))
        elif key not in fields:
            out.append(_unknown(where, key, sorted(fields)))
        else:
            _check_value(value, fields[key], where, out)


def _check_value(value: Any, spec: str, path: str, out: list[str]) -> None:
    if value == AUTO:
        return
    spec = spec.replace(" (deprecated)", "")
    alts = spec.split("|")
    if not any(_matches(value, a) for a in alts):
        out.append(f"{path}={value!r}: must be {describe(spec)}")
        return
    model = next((a.partition(":")[2] for a in alts if a.startswith("model:")), None)
    if model and isinstance(value, dict):
        _check_model(value, model, path, out)


def schema_problems(user: dict) -> list[str]:
    """One line per unknown, removed or ill-typed key of a DeepSpeed JSON object."""
    out: list[str] = []
    removed = set(K.REMOVED)
    for key, value in user.items():
        if key in removed:
            out.append(_removed(key))
        elif key not in K.TOP_LEVEL:
            out.append(_unknown(key, key, [k for k in K.TOP_LEVEL if k not in removed]))
        elif key in K.SECTIONS:
            _check_value(value, f"model:{K.SECTIONS[key]}", key, out)
        elif key in SCALARS:
            _check_value(value, SCALARS[key], key, out)
    timers = user.get("timers")
    if isinstance(timers, dict) and isinstance(timers.get("throughput"), dict):
        _check_model(timers["throughput"], K.SECTIONS["timers.throughput"], "timers.throughput", out)
    return out
