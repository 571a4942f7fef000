"""What a remote store's reader needs to know beyond the URL: the endpoint, the local cache and
the retry budget. Credentials are never here: the storage client reads them from the environment
and the provider's own files (~/.aws, gcloud's, Azure's), so they reach no config.yaml, log or
summary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GB = 1 << 30
MB = 1 << 20
CACHE_ENV = "LOOM_CACHE_DIR"


def default_cache_dir() -> str:
    """`$LOOM_CACHE_DIR/objects`, else `~/.cache/loom/objects` (one cache per node by default)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "loom")
    return os.path.join(base, "objects")


@dataclass(frozen=True)
class StorageSettings:
    """One object store and the node-local cache in front of it (frozen: shards pickle it)."""

    endpoint_url: str | None = None   # an S3-compatible endpoint (MinIO, R2, a local server); None: AWS
    profile: str | None = None        # a named profile of the provider's credential files
    region: str | None = None
    retry_s: float = 120.0            # how long one read may keep retrying before the run stops
    timeout_s: float = 30.0           # one request's connect/read timeout
    cache_dir: str = ""               # "" = default_cache_dir()
    cache_max_bytes: int = 50 * GB    # every file under cache_dir counts; only data chunks are evicted
    chunk_bytes: int = 8 * MB         # one ranged GET and one cache file
    prefetch: int = 4                 # micro batches ahead of the loader whose chunks are fetched early

    @property
    def cache_root(self) -> Path:
        return Path(self.cache_dir or default_cache_dir()).expanduser()

    def describe(self) -> str:
        """The launch line's words: where the cache is and how big it may grow."""
        where = f" via {self.endpoint_url}" if self.endpoint_url else ""
        return (f"cache {self.cache_root} (at most {self.cache_max_bytes / GB:g} GB, {self.chunk_bytes / MB:g} MB "
                f"chunks, prefetch {self.prefetch} micro batches ahead){where}")

