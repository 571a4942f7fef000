"""The `_target_` allow-list: configs, recipes and overrides may only name code under
allowed module prefixes. Hydra 1.3 only blocks a short deny-list (and says it is not
exhaustive), so Loom checks every `_target_` of the composed config before anything is
instantiated."""

from __future__ import annotations

from typing import Any

ALLOWED_PREFIXES = ("loom.", "torch.", "pytorch_lightning.", "lightning.", "transformers.", "datasets.")


def targets(node: Any, path: str = "") -> list[tuple[str, str]]:
    """(full key, value) of every `_target_` in a plain container."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{path}.{k}" if path else str(k)
            if k == "_target_":
                if v is not None:  # a null `_target_` (not filled in yet) names no code
                    found.append((key, str(v)))
            else:
                found += targets(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += targets(v, f"{path}[{i}]")
    return found


def disallowed_targets(container: dict[str, Any]) -> list[tuple[str, str]]:
    extra = tuple(str(p) for p in (container.get("security") or {}).get("allow_targets") or [])
    allowed = ALLOWED_PREFIXES + tuple(p if p.endswith(".") else p + "." for p in extra)
    return [(k, v) for k, v in targets(container) if not (v + ".").startswith(allowed)]
