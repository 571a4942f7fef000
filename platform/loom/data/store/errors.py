"""The one error every bad token store raises, so callers catch a single type."""

from __future__ import annotations

FIX = "re-run `loom data prepare` or re-copy the file"


class StoreError(ValueError):
    """A store that cannot be read: one paragraph naming the path, what is wrong, and the fix."""
