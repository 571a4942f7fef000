"""The config groups' packages (conf/<group>/ -> loom/<package>/) and the keys a node may hold."""

from __future__ import annotations

import dataclasses
import functools
import typing
from types import ModuleType
from typing import Any

from loom import data, eval, float8, hardware, models, objectives, optim, strategies, tracking
from loom.schema import GROUPS, SECTIONS, TOP_LEVEL, field_names

# The package of each config group (conf/<group>/ -> loom/<package>/): each has SCHEMAS (option
# name -> schema; "*" when every option shares one), normalize(cfg) and check(cfg, layout).
GROUP_PACKAGES: dict[str, ModuleType] = {
    "hardware": hardware, "strategy": strategies, "dataset": data,
    "model": models, "optim": optim, "tracking": tracking, "eval": eval, "objective": objectives,
    "float8": float8,
}


def valid_keys(parent: str) -> list[str]:
    """The keys a config node may hold: the top level, a section, or any option of a group."""
    if not parent:
        return sorted([*TOP_LEVEL, *SECTIONS, *GROUPS])
    if parent in SECTIONS:
        return field_names(SECTIONS[parent])
    if parent in GROUP_PACKAGES:
        names: dict[str, None] = {}
        for schema in GROUP_PACKAGES[parent].SCHEMAS.values():
            names.update((f.name, None) for f in dataclasses.fields(schema))
        return list(names)
    return []


@functools.cache
def open_dicts() -> frozenset[str]:
    """`group.field` of every option schema field typed `dict[str, Any]` (model.overrides,
    model.module, model.loss): its keys are the user's (an architecture's config, a class's
    arguments), so any key may be set there, with or without `+`; the option's own check names
    the valid ones. Hydra's struct mode would refuse a key its YAML lacks (`overrides: {}`)."""
    out: set[str] = set()
    for group, package in GROUP_PACKAGES.items():
        for schema in package.SCHEMAS.values():
            hints = typing.get_type_hints(schema)
            out.update(f"{group}.{f.name}" for f in dataclasses.fields(schema) if hints.get(f.name) == dict[str, Any])
    return frozenset(out)
