"""Derive `deepspeed_keys.py` (the torch-free key/type table) from DeepSpeed's own config code.

Importing DeepSpeed's config models imports torch (seconds), so validation cannot ask them;
this module builds the same table from them, and tests/test_deepspeed_json.py compares it with
the shipped one so it cannot drift. After upgrading DeepSpeed:

    python -m loom.strategies.deepspeed_keys_gen > platform/loom/strategies/deepspeed_keys.py

Top-level keys: every key `DeepSpeedConfig` reads from its dict (recorded while it parses a
minimal config). Sections: the pydantic models (`extra="forbid"`) DeepSpeed builds from them,
field by field (name and alias), with the type and numeric bounds pydantic enforces.
"""

from __future__ import annotations

import enum
import os
import pprint
import types
import typing
from typing import Any

# Which pydantic model DeepSpeed builds from which key: (dotted key, module, class).
_SECTION_MODELS = (
    ("zero_optimization", "deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    ("bf16", "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    ("bfloat16", "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    ("fp16", "deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    ("tensorboard", "deepspeed.monitor.config", "TensorBoardConfig"),
    ("wandb", "deepspeed.monitor.config", "WandbConfig"),
    ("csv_monitor", "deepspeed.monitor.config", "CSVConfig"),
    ("comet", "deepspeed.monitor.config", "CometConfig"),
    ("comms_logger", "deepspeed.comm.config", "CommsLoggerConfig"),
    ("hybrid_engine", "deepspeed.runtime.config", "HybridEngineConfig"),
    ("compile", "deepspeed.compile.config", "CompileConfig"),
    ("tensor_parallel", "deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"),
    ("timers.throughput", "deepspeed.utils.config", "DeepSpeedThroughputTimerConfig"),
)


def _bounds(metadata: list) -> str:
    out = []
    for m in metadata:
        for op in ("ge", "gt", "le", "lt"):
            if getattr(m, op, None) is not None:
                out.append(f"{op}={getattr(m, op)}")
    return (":" + ",".join(out)) if out else ""


def _spec(ann: Any, metadata: list, models: dict) -> str:
    """The table's type spec of one annotation: alternatives joined by `|`."""
    from pydantic import BaseModel

    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        return "|".join(_spec(a, metadata, models) for a in typing.get_args(ann))
    if origin is typing.Literal:
        return "enum:" + ",".join(str(v) for v in typing.get_args(ann))
    if ann is type(None):
        return "null"
    if ann is bool:
        return "bool"
    if ann in (int, float):
        return ann.__name__ + _bounds(metadata)
    if ann is str or (isinstance(ann, type) and ann.__name__.endswith("Path")):
        return "str"
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return "enum:" + ",".join(str(m.value) for m in ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        _model(ann, models)
        return "model:" + ann.__name__
    if origin in (list, tuple) or ann in (list, tuple):
        return "list"
    if origin is dict or ann is dict:
        return "dict"
    return "any"


def _model(cls: type, models: dict) -> None:
    if cls.__name__ in models:
        return
    fields: dict[str, str] = {}
    models[cls.__name__] = fields
    for name, f in cls.model_fields.items():
        spec = _spec(f.annotation, list(f.metadata), models)
        extra = f.json_schema_extra or {}
        if extra.get("deprecated"):
            spec += " (deprecated)"
        fields[name] = spec
        if f.alias and f.alias != name:
            fields[f.alias] = spec
    models[cls.__name__] = dict(sorted(fields.items()))


def _top_level_keys() -> list[str]:
    """Every top-level key DeepSpeedConfig looks up while parsing (recorded on a dict)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Keys(list):
        def __contains__(self, k: object) -> bool:
            seen.add(str(k))
            return list.__contains__(self, k)

    class Recording(dict):
        def get(self, k, *default):
            seen.add(k)
            return super().get(k, *default)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k) -> bool:
            seen.add(k)
            return super().__contains__(k)

        def keys(self):  # `key in d.keys()` is a lookup too
            return Keys(super().keys())

    DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1}))
    return sorted(seen)


def table_from_deepspeed() -> dict[str, Any]:
    """The table as `deepspeed_keys.py` ships it, derived from the installed DeepSpeed."""
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime import config as ds_config

    models: dict[str, dict[str, str]] = {}
    sections: dict[str, str] = {}
    for key, module, name in _SECTION_MODELS:
        cls = getattr(importlib.import_module(module), name)
        _model(cls, models)
        sections[key] = name
    return {
        "DEEPSPEED_VERSION": deepspeed.__version__,
        "TOP_LEVEL": _top_level_keys(),
        "REMOVED": sorted(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS),
        "REMOVED_ZERO": sorted(ds_config._REMOVED_ZERO_CONFIG_KEYS),
        "SECTIONS": sections,
        "MODELS": dict(sorted(models.items())),
    }


HEADER = '''"""DeepSpeed's config keys and types, torch-free: what validation checks a user's JSON against.

GENERATED by `python -m loom.strategies.deepspeed_keys_gen` from the installed DeepSpeed's own
config code (see that module); tests/test_deepspeed_json.py fails when they differ.
TOP_LEVEL: every key DeepSpeedConfig reads; REMOVED*: keys DeepSpeed refuses as removed;
SECTIONS: keys parsed by a pydantic model (extra keys forbidden); MODELS: each model's fields
(name and alias) -> type spec (`|` alternatives; `int:ge=0` bounds; `enum:a,b`; `model:Name`).
"""

# fmt: off
'''


def render(table: dict[str, Any]) -> str:
    body = "".join(f"{k} = {pprint.pformat(v, width=110, sort_dicts=False)}\n\n" for k, v in table.items())
    return HEADER + body.rstrip() + "\n"


if __name__ == "__main__":
    print(render(table_from_deepspeed()), end="")
