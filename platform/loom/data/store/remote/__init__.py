"""Token stores in object storage: the same shards as on local disk, their indexes fetched whole
to the node's cache and their tokens read by ranged chunks through it (loom.data.store.remote.cache),
over fsspec's clients (loom.data.store.remote.transport)."""
