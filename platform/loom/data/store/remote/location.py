"""Where a store lives: a local path or an object-store URL (`s3://bucket/key`, `gs://`, `az://`).

No import beyond the standard library: the launcher and `loom data` ask this before anything else,
and a local path must never pull in a storage client.
"""

from __future__ import annotations

import hashlib

# URL scheme -> the fsspec implementation's package (what `pip install` brings the scheme)
SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def scheme_of(path: str) -> str | None:
    """The object-store scheme of `path` ("s3", "gs", ...), or None for a local path."""
    head, sep, _ = str(path).partition("://")
    return head.lower() if sep and head.lower() in SCHEMES else None


def is_remote(path: object) -> bool:
    return scheme_of(str(path)) is not None


def join(url: str, *names: str) -> str:
    """`url` with `names` appended by "/" (object keys never take the local separator)."""
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def key_of(url: str) -> str:
    """A short, filesystem-safe key for `url` (the cache's folder name for one object or store)."""
    return hashlib.sha1(url.encode()).hexdigest()[:20]
