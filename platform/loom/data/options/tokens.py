"""`dataset=tokens`: one or more prepared token stores, mixed by weight. No torch here: the
launcher parses the mixture, opens every store's index (memory maps, no scans) and checks
tokenizers and vocabularies before any process starts.

    loom train dataset=tokens dataset.mix='[{path: /data/tok/web, weight: 0.7}, {path: /data/tok/code, weight: 0.3}]'
    loom train dataset=tokens dataset.mix='[/megatron/out/my_text_document]'    # a Megatron prefix, weight 1
    loom train dataset=tokens dataset.mix='[s3://corpora/tok/web]' dataset.cache.max_gb=200   # object storage
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from loom.data.fingerprint import DataInputs
from loom.data.option import DatasetOption, always
from loom.data.store.remote.location import is_remote
from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout

PACKINGS = ("concat", "documents")
FLAT_DTYPES = ("uint16", "uint32")
EXAMPLE = "dataset.mix='[{path: /data/tok/web, weight: 0.7}, {path: /data/tok/code, weight: 0.3}]'"


@dataclass
class CacheConfig:
    """The node's cache in front of object storage (sources at s3://, gs://, az://)."""

    dir: str | None = None   # null: $LOOM_CACHE_DIR/objects, else ~/.cache/loom/objects
    max_gb: float = 50.0     # every file in it counts (indexes too); least recently used chunks go first
    chunk_mb: float = 8.0    # one ranged read and one cache file
    prefetch: int = 4        # micro batches ahead of the loader whose chunks are fetched early (0: off)


@dataclass
class StorageConfig:
    """How to reach object storage. No credentials here: the client reads the environment and the
    provider's own files (AWS_* / ~/.aws, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)."""

    endpoint_url: str | None = None  # an S3-compatible endpoint (MinIO, R2, Ceph); null: the provider's
    profile: str | None = None       # a named profile of the credential files
    region: str | None = None
    retry_s: float = 120.0           # a read retries this long (backoff) before the run stops naming the object
    timeout_s: float = 30.0          # one request's connect/read timeout


@dataclass
class TokensDatasetConfig:
    name: str = "tokens"
    batch_size: int = 16
    seq_len: int = 128
    # the sources: a store path each (a `loom data prepare` dir, a Megatron prefix, a nanoGPT .bin),
    # or {path, weight (default 1), name (default: the path's last part)}
    mix: list[Any] = field(default_factory=list)
    packing: str = "concat"           # concat | documents (no attention across documents)
    val_fraction: float | None = 0.005  # of each source's windows, held out (every k-th window)
    dtype: str | None = None          # a flat nanoGPT .bin's tokens: uint16 (default) | uint32
    tokenizer: str | None = None      # the run's tokenizer: checked against the stores' sidecars
    cache: CacheConfig = field(default_factory=CacheConfig)        # remote sources only
    storage: StorageConfig = field(default_factory=StorageConfig)  # remote sources only


@dataclass(frozen=True)
class Source:
    path: str
    weight: float
    name: str


def _entry(i: int, raw) -> Source:
    key = f"dataset.mix[{i}]"
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, dict) or not raw.get("path"):
        fail(key, raw, f"each source is a store path or {{path: ..., weight: ...}}, e.g. {EXAMPLE}")
    unknown = set(raw) - {"path", "weight", "name"}
    if unknown:
        fail(key, raw, f"unknown key(s) {sorted(unknown)}; a source has path, weight (default 1) and name")
    try:
        weight = float(str(raw.get("weight", 1)))
    except ValueError:
        weight = float("nan")
    if not weight > 0 or weight == float("inf"):
        fail(f"{key}.weight", raw.get("weight"), "must be a positive number (weights are relative: 7 and 3 "
             "mean 70% and 30%)")
    path = str(raw["path"])
    name = str(raw.get("name") or Path(path.rstrip("/")).name)
    return Source(path, weight, name)


def sources(ds: DictConfig) -> list[Source]:
    """The mixture's sources, parsed (weights as given; Blend reads them as exact decimals)."""
    mix = OmegaConf.to_container(ds.mix) if isinstance(ds.mix, ListConfig) else ds.mix
    if isinstance(mix, str | dict):
        mix = [mix]
    if not mix:
        fail("dataset.mix", mix, f"list at least one token store, e.g. {EXAMPLE} (make one with "
             "`loom data prepare FILES --out DIR`)")
    out = [_entry(i, raw) for i, raw in enumerate(mix)]
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        fail("dataset.mix", names, "two sources share a name; give each a `name:`")
    return out


def storage_settings(ds: DictConfig):
    """The run's StorageSettings from dataset.storage and dataset.cache (defaults where absent)."""
    from loom.data.store import StorageSettings

    st, ca = ds.get("storage") or {}, ds.get("cache") or {}
    return StorageSettings(
        endpoint_url=st.get("endpoint_url"), profile=st.get("profile"), region=st.get("region"),
        retry_s=float(st.get("retry_s", 120.0)), timeout_s=float(st.get("timeout_s", 30.0)),
        cache_dir=str(ca.get("dir") or ""), cache_max_bytes=int(float(ca.get("max_gb", 50.0)) * (1 << 30)),
        chunk_bytes=int(float(ca.get("chunk_mb", 8)) * (1 << 20)), prefetch=int(ca.get("prefetch", 4)))


@functools.lru_cache(maxsize=32)
def _open(path: str, dtype: str | None, storage):
    from loom.data.store import open_store

    return open_store(path, dtype, storage)


def _local_or_url(path: str) -> str:
    from loom.data.store import is_remote

    return path if is_remote(path) else str(Path(path).expanduser())


def open_source(ds: DictConfig, i: int, src: Source):
    """The store of source i, or a ConfigError naming dataset.mix[i].path and the store's problem
    (a missing storage client, or storage that does not answer within dataset.storage.retry_s, too)."""
    from loom.data.store import StoreError
    from loom.data.store.remote.transport import StorageUnavailable

    try:
        return _open(_local_or_url(src.path), ds.get("dtype"), storage_settings(ds))
    except StorageUnavailable as e:  # an outage, not a bad config: a later try (or a rank's restart) may pass
        raise StorageUnavailable(f"dataset.mix[{i}].path={src.path!r}: {e}") from None
    except (StoreError, ImportError, PermissionError) as e:
        raise ConfigError(f"Invalid config: dataset.mix[{i}].path={src.path!r}: {e}") from None


def normalize_tokens(cfg: DictConfig) -> None:
    ds = cfg.dataset
    parsed = sources(ds)
    from loom.data.store import is_remote

    ds.mix = [{"path": s.path if is_remote(s.path) else str(Path(s.path).expanduser().absolute()),
               "weight": s.weight, "name": s.name} for s in parsed]


def _tokenizer_of(ds: DictConfig, stores: list) -> None:
    """Every store with a sidecar was written by one tokenizer, the run's `dataset.tokenizer`."""
    from loom.data.prepare import tokenizer_fingerprint

    marks = {(st.sidecar or {}).get("tokenizer_fingerprint"): st for st in stores if st.sidecar}
    if len(marks) > 1:
        names = ", ".join(f"{st.path} ({st.sidecar.get('tokenizer')})" for st in marks.values())
        fail("dataset.mix", [str(st.path) for st in stores], f"the stores were written by different tokenizers "
             f"({names}); a run reads one vocabulary: prepare them all with the same --tokenizer")
    if marks and ds.get("tokenizer"):
        want = tokenizer_fingerprint(str(ds.tokenizer))
        (have, st), = marks.items()
        if have != want:
            fail("dataset.tokenizer", ds.tokenizer, f"differs from the tokenizer {st.path} was prepared with "
                 f"({st.sidecar.get('tokenizer') or 'byte-level'}): its ids mean other tokens. Use that "
                 "tokenizer, or prepare the store again with this one")


def check_storage(ds: DictConfig) -> None:
    """dataset.cache and dataset.storage, for a mixture with a remote source."""
    ca, st = ds.get("cache") or {}, ds.get("storage") or {}
    if not float(ca.get("max_gb", 50)) > 0:
        fail("dataset.cache.max_gb", ca.get("max_gb"), "must be positive: the node's cache size in GB")
    chunk = ca.get("chunk_mb", 8)
    if not isinstance(chunk, int | float) or not 1 / 16 <= chunk <= 1024:
        fail("dataset.cache.chunk_mb", chunk, "must be in [0.0625, 1024] MB (one ranged read; 8 suits most stores)")
    if float(ca.get("max_gb", 50)) * 1024 < 16 * chunk:
        fail("dataset.cache.max_gb", ca.get("max_gb"), f"holds fewer than 16 chunks of {chunk} MB: the ranks of a "
             "node and their prefetch need room; raise it or lower dataset.cache.chunk_mb")
    if not isinstance(ca.get("prefetch", 4), int) or ca.get("prefetch", 4) < 0:
        fail("dataset.cache.prefetch", ca.get("prefetch"), "micro batches fetched ahead: a whole number >= 0 (0: off)")
    for key in ("retry_s", "timeout_s"):
        if not float(st.get(key, 1)) > 0:
            fail(f"dataset.storage.{key}", st.get(key), "must be a positive number of seconds")
    url = st.get("endpoint_url")
    if url is not None:
        head, sep, rest = str(url).partition("://")
        if not sep or head not in ("http", "https"):
            fail("dataset.storage.endpoint_url", url, "an http(s):// URL of an S3-compatible endpoint, e.g. "
                 "https://minio.lan:9000")
        if "@" in rest.split("/", 1)[0]:
            fail("dataset.storage.endpoint_url", "<with credentials>", "credentials never go in the config: "
                 "give the endpoint without them and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile)")


def check_tokens(cfg: DictConfig, layout: ParallelLayout) -> None:
    ds = cfg.dataset
    if ds.packing not in PACKINGS:
        fail("dataset.packing", ds.packing, f"valid choices: {', '.join(PACKINGS)} (documents: attention "
             "never crosses a document boundary)")
    if ds.get("dtype") is not None and ds.dtype not in FLAT_DTYPES:
        fail("dataset.dtype", ds.dtype, f"a flat (nanoGPT) .bin holds {' or '.join(FLAT_DTYPES)} tokens")
    fraction = ds.val_fraction
    if fraction is not None and not 0 <= fraction < 1:
        fail("dataset.val_fraction", fraction, "must be in [0, 1): the share of each source's windows held "
             "out for validation (0 or null: none)")
    srcs = sources(ds)
    if any(is_remote(s.path) for s in srcs):
        check_storage(ds)
    stores = [open_source(ds, i, s) for i, s in enumerate(srcs)]
    _tokenizer_of(ds, stores)
    from loom.data.index.windows import Holdout, windows_of

    for i, (src, st) in enumerate(zip(srcs, stores, strict=True)):
        n = Holdout.of(windows_of(st.n_tokens, ds.seq_len), fraction).n_train
        if n == 0:
            fail(f"dataset.mix[{i}].path", src.path, f"the store holds {st.n_tokens:,} tokens, not one training "
                 f"window of dataset.seq_len+1={ds.seq_len + 1}")


def vocab(ds: DictConfig) -> int | None:
    """The data's vocabulary: the sidecars' (stores from other tools have none), else the
    run's tokenizer's; None when nothing says (ids are then checked against the model per batch)."""
    sizes = [int(st.sidecar["vocab_size"]) for i, s in enumerate(sources(ds))
             if (st := open_source(ds, i, s)).sidecar and st.sidecar.get("vocab_size")]
    if sizes:
        return max(sizes)
    if ds.get("tokenizer"):
        from loom.data.checks import tokenizer_vocab

        return tokenizer_vocab(str(ds.tokenizer))
    return None


def mean_document(ds: DictConfig) -> float | None:
    """The mixture's mean document length in tokens, weighted as drawn (None: a flat store)."""
    srcs = sources(ds)
    stores = [open_source(ds, i, s) for i, s in enumerate(srcs)]
    if any(not st.n_docs for st in stores):
        return None
    total = sum(s.weight for s in srcs)
    return sum(s.weight * st.n_tokens / st.n_docs for s, st in zip(srcs, stores, strict=True)) / total


def inputs(ds: DictConfig) -> DataInputs:
    """The stores' files (sizes and times only), a remote store's objects by version tag: a store
    rewritten is a new run."""
    files: list[Path] = []
    remote: list[str] = []
    for i, s in enumerate(sources(ds)):
        st = open_source(ds, i, s)
        if isinstance(st.path, str):
            remote.append(_remote_versions(st))
        else:
            files += _store_files(st)
    return DataInputs(files=[f for f in files if f.is_file()], note="; ".join(remote) or None)


def _remote_versions(store) -> str:
    """A remote store in one line: its URL, and a digest of its objects' sizes and version tags."""
    import hashlib

    h = hashlib.sha1()
    for shard in store.shards:
        h.update(f"{shard.blob.url}|{shard.blob.size}|{shard.blob.etag}|{store.n_tokens}\n".encode())
    return f"{store.path}: {len(store.shards)} objects' versions digest {h.hexdigest()[:16]}"


def _store_files(store) -> list[Path]:
    """A store's files: each shard's index and tokens (or flat file), and its sidecar."""
    from loom.data.store import SIDECAR

    out = [Path(store.path) / SIDECAR] if store.sidecar else []
    for shard in store.shards:
        out += [Path(p) for p in (getattr(shard, "idx_path", None), getattr(shard, "bin_path", None),
                                  getattr(shard, "path", None)) if p is not None]
    return out


def source(ds: DictConfig) -> str:
    """The launch line's words: each source, where it lives, and the cache a remote one reads through."""
    parts, remote = [], False
    for i, s in enumerate(sources(ds)):
        st = open_source(ds, i, s)
        note = "" if st.sidecar else ", no sidecar (written by another tool: ids checked per batch)"
        where = f" at {st.path}" if isinstance(st.path, str) else ""
        remote = remote or bool(where)
        parts.append(f"{s.name} {st.kind} {st.n_tokens:,} tokens w={s.weight:g}{where}{note}")
    cache = ""
    if remote:
        from loom.redaction import redact

        cache = f"; object storage through the node's {redact(storage_settings(ds).describe())}"
    return f"{len(parts)} store(s): " + "; ".join(parts) + cache


def val_size(ds: DictConfig) -> int | None:
    from loom.data.index.windows import Holdout, windows_of

    return sum(Holdout.of(windows_of(open_source(ds, i, s).n_tokens, ds.seq_len), ds.val_fraction).n_val
               for i, s in enumerate(sources(ds)))


def datasets(cfg: DictConfig):
    """(the mixture of every source's training windows, its validation windows: one dataset per
    source that has any, a list when several)."""
    from loom.data.mix import Mixture, SourceWindows

    ds = cfg.dataset
    limit = (cfg.get("model") or {}).get("vocab_size")
    kw = {"val_fraction": ds.val_fraction, "documents": ds.packing == "documents",
          "vocab_limit": int(limit) if limit else None}
    train, val = [], []
    srcs = sources(ds)
    for i, s in enumerate(srcs):
        st = open_source(ds, i, s)
        train.append(SourceWindows(st, s.name, ds.seq_len, part="train", **kw))
        held = SourceWindows(st, s.name, ds.seq_len, part="val", **kw)
        if len(held):
            val.append(held)
    mixture = Mixture(train, [s.weight for s in srcs], int(cfg.seed), prefetch_ahead=storage_settings(ds).prefetch)
    return mixture, (val if len(val) > 1 else val[0] if val else None)


OPTION = DatasetOption(TokensDatasetConfig, "loom.data.options.tokens:datasets", always(True), inputs, source,
                       val_size=val_size, check=check_tokens, normalize=normalize_tokens, vocab=vocab,
                       mean_document=mean_document)
