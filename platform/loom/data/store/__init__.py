"""Token stores: Megatron's indexed format (`.bin` + `.idx`), written and read without torch
(the launcher opens stores before torch is imported), plus nanoGPT flat token files.

`ShardWriter` writes what megatron.core's `IndexedDatasetBuilder` writes, byte for byte;
`open_store` memory-maps any store as one token stream and checks sizes at open, never scanning;
a store in object storage (s3://, gs://, az://) is read the same way through `remote` (its indexes
fetched to the node's cache, its tokens by ranged chunks).
"""

from __future__ import annotations

from loom.data.store.errors import StoreError
from loom.data.store.megatron import DTYPE_CODES, ShardWriter, dtype_code, optimal_dtype
from loom.data.store.open import FLAT_DTYPES, TokenStore, open_local
from loom.data.store.remote.location import is_remote
from loom.data.store.remote.settings import StorageSettings
from loom.data.store.shards import FlatShard, IndexedShard
from loom.data.store.sidecar import PREPARE_DIR, SIDECAR, read_sidecar, write_sidecar


def open_store(path, dtype: str | None = None, storage: StorageSettings | None = None) -> TokenStore:
    """The store at `path`, a local path or an object-store URL (`storage`: its endpoint, cache
    and retry budget; default ones when None). StoreError naming what is wrong."""
    if is_remote(path):
        from loom.data.store.remote.open import open_remote

        return open_remote(str(path), dtype, storage or StorageSettings())
    return open_local(path, dtype)


__all__ = [
    "DTYPE_CODES", "FLAT_DTYPES", "PREPARE_DIR", "SIDECAR", "FlatShard", "IndexedShard", "ShardWriter",
    "StorageSettings", "StoreError", "TokenStore", "is_remote", "open_local", "dtype_code", "open_store", "optimal_dtype", "read_sidecar", "write_sidecar",
]
