"""The one walk over plain config containers (dicts and lists) that the secret and
`_target_` checks share: each finds the keys a predicate matches, with their full dotted keys."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def find_keys(obj: Any, match: Callable[[Any, Any], bool], path: str = "") -> list[tuple[str, Any]]:
    """(full key, value) of every `key: value` for which `match(key, value)` holds, in order;
    a matched value is not searched further. List items are keyed `path[i]`."""
    found: list[tuple[str, Any]] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if match(k, v):
                found.append((key, v))
            else:
                found += find_keys(v, match, key)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += find_keys(v, match, f"{path}[{i}]")
    return found
