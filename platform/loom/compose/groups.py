"""The config groups' packages (conf/<group>/ -> loom/<package>/) and the keys a node may hold."""

from __future__ import annotations

import dataclasses
from types import ModuleType

from loom import data, hardware, models, optim, strategies, tracking
from loom.schema import GROUPS, SECTIONS, TOP_LEVEL, field_names

# The package of each config group (conf/<group>/ -> loom/<package>/): each has SCHEMAS (option
# name -> schema; "*" when every option shares one), normalize(cfg) and check(cfg, layout).
GROUP_PACKAGES: dict[str, ModuleType] = {
    "hardware": hardware, "strategy": strategies, "dataset": data,
    "model": models, "optim": optim, "tracking": tracking,
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
