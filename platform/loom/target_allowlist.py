"""The `_target_` allow-list: configs, recipes and overrides may only name code under
allowed module prefixes. Hydra 1.3 only blocks a short deny-list (and says it is not
exhaustive), so Loom checks every `_target_` of the composed config before anything is
instantiated."""

from __future__ import annotations

from typing import Any

from loom.tree import find_keys

ALLOWED_PREFIXES = ("loom.", "torch.", "pytorch_lightning.", "lightning.", "transformers.", "datasets.")


def targets(node: Any) -> list[tuple[str, str]]:
    """(full key, value) of every `_target_` in a plain container; a null `_target_` (not
    filled in yet) names no code."""
    return [(k, str(v)) for k, v in find_keys(node, lambda k, v: k == "_target_") if v is not None]


def disallowed_targets(container: dict[str, Any]) -> list[tuple[str, str]]:
    extra = tuple(str(p) for p in (container.get("security") or {}).get("allow_targets") or [])
    allowed = ALLOWED_PREFIXES + tuple(p if p.endswith(".") else p + "." for p in extra)
    return [(k, v) for k, v in targets(container) if not (v + ".").startswith(allowed)]
