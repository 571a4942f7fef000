"""Token stores: Megatron's indexed format (`.bin` + `.idx`), written and read without torch
(the launcher opens stores before torch is imported), plus nanoGPT flat token files.

`ShardWriter` writes what megatron.core's `IndexedDatasetBuilder` writes, byte for byte;
`open_store` memory-maps any store as one token stream and checks sizes at open, never scanning.
"""

from __future__ import annotations

from loom.data.store.errors import StoreError
from loom.data.store.megatron import DTYPE_CODES, ShardWriter, dtype_code, optimal_dtype
from loom.data.store.open import FLAT_DTYPES, TokenStore, open_store
from loom.data.store.shards import FlatShard, IndexedShard
from loom.data.store.sidecar import PREPARE_DIR, SIDECAR, read_sidecar, write_sidecar

__all__ = [
    "DTYPE_CODES", "FLAT_DTYPES", "PREPARE_DIR", "SIDECAR", "FlatShard", "IndexedShard", "ShardWriter",
    "StoreError", "TokenStore", "dtype_code", "open_store", "optimal_dtype", "read_sidecar", "write_sidecar",
]
