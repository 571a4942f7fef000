"""`~key`: Hydra's delete override, with the meaning the schema gives it.

Hydra deletes the key from the composed config, and Loom's typed schema would then fill its
default back in: the override would be silently ignored. Instead, per the schema:
  - an optional key (its type admits null) becomes null, its "absent" meaning
    (`~trainer.gradient_clip_val`: no clipping, `~dataset.max_bytes`: no cap, `~run.id`: derived);
  - an entry of an open dict (`~sweep.params.optim.lr`, `~hardware.peak_tflops.fp32`) is deleted;
  - a required key (`~trainer.max_steps`, `~experiment`) is refused, exit 2, naming the key;
  - a config group: `~tracking` is `tracking=none`, `~recipe` drops the recipe; the other groups
    (hardware, strategy, dataset, model, optim) are required and refused.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from loom.compose.groups import GROUP_PACKAGES, valid_keys
from loom.compose.paths import group_options
from loom.errors import ConfigError
from loom.schema import GROUPS, SECTIONS, TOP_LEVEL, field_names, unknown_key_message

# Groups whose removal has a meaning: the option it selects (None: no option at all).
OPTIONAL_GROUPS = {"tracking": "tracking=none", "recipe": None}


def split_removals(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the other overrides, the keys removed with `~key` or `~key=value`). A removed group
    becomes its "none" option here; a required group is refused."""
    rest: list[str] = []
    removed: list[str] = []
    for o in overrides:
        if not o.startswith("~"):
            rest.append(o)
            continue
        key = o[1:].partition("=")[0].strip()
        if key in OPTIONAL_GROUPS:
            rest = [r for r in rest if not r.startswith(f"{key}=")]
            if OPTIONAL_GROUPS[key]:
                rest.append(OPTIONAL_GROUPS[key])
        elif key in GROUPS:
            raise ConfigError(
                f"Invalid config: ~{key}: the {key} group is required (a run needs one); it cannot be "
                f"removed. Choose another option with {key}=<option>. Valid choices for {key}: "
                f"{', '.join(group_options(key))}.")
        else:
            removed.append(key)
    return rest, removed


def apply_removals(cfg: DictConfig, removed: list[str]) -> None:
    """Null the optional keys and delete the dict entries of `removed` in the composed `cfg`."""
    for key in removed:
        dict_path = _kind(cfg, key)
        with open_dict(cfg):
            if dict_path is None:
                OmegaConf.update(cfg, key, None, force_add=True)
                continue
            node = OmegaConf.select(cfg, dict_path)
            entry = key[len(dict_path) + 1:]  # dict keys may hold dots: sweep.params.optim.lr
            if isinstance(node, DictConfig) and entry in node:
                del node[entry]


def _kind(cfg: DictConfig, key: str) -> str | None:
    """None for an optional key (it may be null); the dict's path for an entry of an open dict.
    A required or unknown key is refused."""
    head, *path = key.split(".")
    if head in TOP_LEVEL:
        raise ConfigError(_required(key, OmegaConf.select(cfg, key), "a required top-level key"))
    if head in SECTIONS and not path:
        raise ConfigError(f"Invalid config: ~{key}: {key} is a section of the run config and cannot be "
                          f"removed; remove or set its optional keys instead, e.g. ~trainer.gradient_clip_val.")
    if head in SECTIONS:
        schema: Any = SECTIONS[head]
    elif head in GROUPS:
        schema = _group_schema(cfg, head)
    else:
        raise ConfigError(unknown_key_message(key, None, valid_keys("")))
    walked = head
    for i, part in enumerate(path):
        hints = typing.get_type_hints(schema)
        if part not in hints:
            raise ConfigError(unknown_key_message(f"{walked}.{part}", None, field_names(schema)))
        walked, typ = f"{walked}.{part}", hints[part]
        if i == len(path) - 1:
            if _optional(typ):
                return None
            raise ConfigError(_required(key, OmegaConf.select(cfg, key), f"required ({_type_name(typ)})"))
        if typing.get_origin(_non_none(typ)) is dict:
            return walked
        schema = _dataclass_in(typ)
        if schema is None:
            raise ConfigError(f"Invalid config: ~{key}: {walked} holds a single value, not {key}.")
    return None


def _group_schema(cfg: DictConfig, group: str) -> type:
    schemas = GROUP_PACKAGES[group].SCHEMAS
    name = OmegaConf.select(cfg, f"{group}.name")
    schema = schemas.get(name) or schemas.get("*")
    if schema is None:
        raise ConfigError(f"Invalid config: {group}.name={name!r} has no schema in Loom. "
                          f"Valid choices for {group}: {', '.join(sorted(schemas))}.")
    return schema


def _args(typ: Any) -> tuple[Any, ...]:
    return typing.get_args(typ) if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union \
        else (typ,)


def _optional(typ: Any) -> bool:
    return type(None) in _args(typ)


def _non_none(typ: Any) -> Any:
    rest = [a for a in _args(typ) if a is not type(None)]
    return rest[0] if rest else typ


def _dataclass_in(typ: Any) -> type | None:
    inner = _non_none(typ)
    return inner if dataclasses.is_dataclass(inner) else None


def _type_name(typ: Any) -> str:
    return f"{getattr(typ, '__name__', str(typ))}, never null"


def _required(key: str, value: Any, why: str) -> str:
    now = f" (now {key}={value})" if value is not None and not isinstance(value, DictConfig) else ""
    return (f"Invalid config: ~{key}: {key} is {why}: it cannot be removed. Set it instead, "
            f"e.g. {key}=<value>{now}.")
