"""Open a token store in object storage as a TokenStore: one listing, the sidecar, each shard's
index fetched whole into the node's cache (its size, and its SHA-256 where the sidecar records
one, checked) and each token file read by ranged chunks (`RemoteBlob`), sizes checked at open as a
local store's are. The layouts are a local store's: a `loom data prepare` store (loom.json), a
folder of Megatron prefixes, one Megatron prefix, or a flat nanoGPT .bin."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from loom.data.store.errors import FIX, StoreError
from loom.data.store.open import FLAT_DTYPES, TokenStore, listed_shards, one_dtype, refuse_missing
from loom.data.store.remote.blob import RemoteBlob
from loom.data.store.remote.location import join, key_of, scheme_of
from loom.data.store.remote.settings import StorageSettings
from loom.data.store.remote.transport import filesystem, retrying
from loom.data.store.shards import FlatShard, IndexedShard
from loom.data.store.sidecar import INDEX_SHA, PREPARE_DIR, SIDECAR, parse_sidecar


class RemoteIndexedShard(IndexedShard):
    """A Megatron prefix in object storage: its .idx mapped from the cache, its .bin a RemoteBlob."""

    def __init__(self, url: str, idx_path: Path, blob: RemoteBlob) -> None:
        self.prefix, self.blob = url, blob
        self.idx_path, self.bin_path = idx_path, blob.url
        self._open_index()

    def __reduce__(self) -> tuple:
        return (RemoteIndexedShard, (self.prefix, self.idx_path, self.blob))

    @property
    def name(self) -> str:
        return self.prefix.rstrip("/").rsplit("/", 1)[-1]

    def _bin_size(self) -> int:
        return self.blob.size

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        return self.blob.tokens(self.dtype, lo, hi)

    def prefetch(self, lo: int, hi: int) -> None:
        self.blob.prefetch(self.dtype, lo, hi)


class RemoteFlatShard(FlatShard):
    """A flat nanoGPT token file in object storage."""

    def __init__(self, blob: RemoteBlob, dtype: np.dtype) -> None:
        self.prefix = self.bin_path = blob.url
        self.blob, self.dtype = blob, dtype
        self.n_tokens = self._whole_tokens(blob.size)

    def __reduce__(self) -> tuple:
        return (RemoteFlatShard, (self.blob, self.dtype))

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1]

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        return self.blob.tokens(self.dtype, lo, hi)

    def prefetch(self, lo: int, hi: int) -> None:
        self.blob.prefetch(self.dtype, lo, hi)


class Listing:
    """The objects under a URL: {name relative to it: (size, version tag)}, from one listing
    (`loom data prepare --out URL` reads its prefix through it too)."""

    def __init__(self, url: str, settings: StorageSettings) -> None:
        self.url, self.settings = url.rstrip("/"), settings
        self.fs = filesystem(url, settings)
        scheme = scheme_of(url)
        self.objects: dict[str, tuple[int, str]] = {}
        found = retrying(f"listing {self.url}", lambda: self.fs.find(self.url, detail=True, withdirs=False),
                         settings)
        root = self.fs._strip_protocol(self.url) + "/"
        for name, entry in found.items():
            if not name.startswith(root):  # the URL itself, or a sibling sharing its prefix
                continue
            rel = name[len(root):]
            tag = str(entry.get("ETag") or entry.get("etag") or entry.get("md5Hash") or entry.get("mtime") or "")
            self.objects[rel] = (int(entry.get("size") or 0), tag)
        self.scheme = scheme

    def blob(self, rel: str) -> RemoteBlob:
        size, tag = self.objects[rel]
        return RemoteBlob(join(self.url, rel), size, tag, self.settings)

    def text(self, rel: str) -> str:
        url = join(self.url, rel)
        return retrying(f"reading {url}", lambda: self.fs.cat_file(url), self.settings).decode()


def open_remote(url: str, dtype: str | None, settings: StorageSettings) -> TokenStore:
    """The store at `url`; StoreError naming what was looked for, as for a local path."""
    url = url.rstrip("/")
    under = Listing(url, settings)
    objs = under.objects
    if SIDECAR in objs:
        return _loom(url, under, parse_sidecar(under.text(SIDECAR), join(url, SIDECAR)))
    if any(k.startswith(PREPARE_DIR + "/") for k in objs):
        raise StoreError(f"{url}: an interrupted `loom data prepare` (it holds {PREPARE_DIR}/ but no {SIDECAR}, "
                         "which is uploaded last): run the same prepare again to resume; finished shards are kept.")
    prefixes = sorted(k[:-4] for k in objs if k.endswith(".idx") and "/" not in k)
    if prefixes:
        return _megatron(url, under, prefixes)
    return _single(url, dtype, settings)


def _single(url: str, dtype: str | None, settings: StorageSettings) -> TokenStore:
    """`url` names one object or prefix: a Megatron prefix (url.idx + url.bin) or a flat .bin."""
    parent, base = url.rsplit("/", 1)
    listing = Listing(parent, settings)
    beside = listing.objects
    stem = base[:-4] if base.endswith((".idx", ".bin")) else base
    if f"{stem}.idx" in beside and f"{stem}.bin" in beside:
        return _megatron(join(parent, stem), listing, [stem], store_url=join(parent, stem))
    if base.endswith(".bin") and base in beside:
        name = dtype or FLAT_DTYPES[0]
        if name not in FLAT_DTYPES:
            raise StoreError(f"{url}: dtype={name!r} for a flat token file: it holds {' or '.join(FLAT_DTYPES)} "
                             "tokens; set the dtype the file was written with.")
        blob = listing.blob(base)
        return TokenStore(url, "flat", np.dtype(name), [RemoteFlatShard(blob, np.dtype(name))])
    if f"{stem}.idx" in beside or f"{stem}.bin" in beside:
        have = f"{stem}.idx" if f"{stem}.idx" in beside else f"{stem}.bin"
        raise StoreError(f"{url}: a Megatron prefix with {have} but not its pair: {FIX}.")
    raise StoreError(f"no token store at {url}: looked for objects under it ({SIDECAR}, Megatron .idx/.bin "
                     f"pairs), a Megatron prefix ({stem}.idx + {stem}.bin) and a flat token file; none exists. Fix "
                     f"the URL, or write a store with `loom data prepare ... --out {url}`.")


def _shard(under: Listing, prefix: str, sha: str | None) -> RemoteIndexedShard:
    """Shard `prefix` (relative to the listing): its index fetched into the cache and checked."""
    idx_url = join(under.url, f"{prefix}.idx")
    idx = under.blob(f"{prefix}.idx")

    def whole() -> bytes:
        data = retrying(f"reading {idx_url}", lambda: under.fs.cat_file(idx_url), under.settings)
        if len(data) != idx.size:
            raise StoreError(f"{idx_url}: {len(data):,} bytes arrived, the listing says {idx.size:,}: {FIX}.")
        if sha is not None and hashlib.sha256(data).hexdigest() != sha:
            raise StoreError(f"{idx_url}: its SHA-256 differs from the one {SIDECAR} records: the index is "
                             f"corrupt or from another prepare: {FIX}.")
        return data

    local = idx.cache.whole(key_of(f"{idx_url}|{idx.etag}|{idx.size}"), f"{prefix.rsplit('/', 1)[-1]}.idx", whole)
    return RemoteIndexedShard(join(under.url, prefix), local, under.blob(f"{prefix}.bin"))


def _loom(url: str, under: Listing, info: dict[str, Any]) -> TokenStore:
    names = listed_shards(info, url)
    refuse_missing(url, names, [n for n in names if not {f"{n}.idx", f"{n}.bin"} <= under.objects.keys()])
    shas = info.get(INDEX_SHA) or {}
    shards = [_shard(under, n, shas.get(n)) for n in names]
    return TokenStore(url, "loom", one_dtype(shards, url, info.get("dtype")), list(shards), info)


def _megatron(url: str, under: Listing, prefixes: list[str], store_url: str | None = None) -> TokenStore:
    missing = [p for p in prefixes if f"{p}.bin" not in under.objects]
    if missing:
        raise StoreError(f"{join(under.url, missing[0])}.bin: missing: the index beside it expects its tokens: {FIX}.")
    shards = [_shard(under, p, None) for p in prefixes]
    return TokenStore(store_url or url, "megatron", one_dtype(shards, url, None), list(shards))
