"""Token stores in object storage (issue 54), in process against a real S3 API: moto's server on
127.0.0.1 behind a proxy that injects 503s, dropped connections, latency and outages
(tests/s3_helpers.py). What a launch adds (loader workers, two ranks on one node cache, a kill
and a resume at another world size) rides on tests/test_elastic.py's fsdp chain."""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import refused
from s3_helpers import LocalS3

from loom.data.store import ShardWriter, StorageSettings, StoreError, open_store, write_sidecar
from loom.data.store.remote.cache import ChunkCache
from loom.data.store.remote.stats import StorageCounters
from loom.data.store.remote.transport import StorageUnavailable

CHUNK = 4096  # bytes: a store of ~60 KB spans ~15 chunks


def _store(d: Path, seed: int = 0, shards: int = 3, docs: int = 40) -> Path:
    rng = np.random.default_rng(seed)
    names = [f"part-{i:05d}" for i in range(shards)]
    shas = {}
    for name in names:
        with ShardWriter(d / name, np.uint16) as w:
            for _ in range(docs):
                w.add_document(rng.integers(1, 250, int(rng.integers(5, 800))))
        shas[name] = hashlib.sha256((d / f"{name}.idx").read_bytes()).hexdigest()
    write_sidecar(d, {"format": "loom-token-store", "version": 1, "shards": names, "tokenizer": None,
                      "tokenizer_fingerprint": "bytes", "vocab_size": 256, "dtype": "uint16", "index_sha256": shas})
    return d


@pytest.fixture(scope="module")
def s3():
    server = LocalS3()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def stores(s3, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("remote")
    local = _store(root / "web")
    url = s3.bucket("corpora") + "/tok/web"
    s3.upload_dir(local, url)
    return {"root": root, "local": local, "url": url}


def _settings(s3: LocalS3, cache: Path, **kw) -> StorageSettings:
    base = {"endpoint_url": s3.endpoint, "cache_dir": str(cache), "chunk_bytes": CHUNK, "retry_s": 20.0,
            "timeout_s": 5.0}
    return StorageSettings(**{**base, **kw})


def _faults_off(s3: LocalS3) -> None:
    f = s3.faults
    f.latency_s, f.fail_next, f.drop_next, f.down = 0.0, 0, 0, False


def test_batches_from_s3_are_byte_identical_to_the_same_store_on_disk(s3, stores, tmp_path):
    """Every window of a documents-packed mixture, through the sampler with prefetch on: the same
    tokens, targets and positions as from local disk; each chunk is fetched once, then served from
    the cache."""
    from loom.data.mix import Mixture, SourceWindows
    from loom.data.sampler import ResumableDistributedSampler

    _faults_off(s3)
    settings = _settings(s3, tmp_path / "cache", prefetch=2)
    remote, local = open_store(stores["url"], storage=settings), open_store(stores["local"])
    assert remote.describe().replace(stores["url"], "X") == local.describe().replace(str(stores["local"]), "X")
    assert remote.n_docs == local.n_docs and remote.n_tokens == local.n_tokens
    assert np.array_equal(remote.read(0, remote.n_tokens), local.read(0, local.n_tokens))

    def mixture(store) -> Mixture:
        return Mixture([SourceWindows(store, "web", 32, part="train", val_fraction=0.1, documents=True)], [1], seed=5)

    a, b = mixture(remote), mixture(local)
    assert a.remote and not b.remote
    sampler = ResumableDistributedSampler(a, num_replicas=2, rank=1, micro_batch=4, shuffle=True, seed=3,
                                          prefetch_ahead=2)
    ids = list(sampler)
    assert len(ids) == len(b) // 8 * 4
    for k in ids:
        x, y = a[k], b[k]
        assert np.array_equal(x.inputs, y.inputs) and np.array_equal(x.targets, y.targets)
        assert np.array_equal(x.positions, y.positions)
    ranged = s3.faults.ranged
    a[ids[0]]  # cached now: no request
    assert s3.faults.ranged == ranged
    chunks = -(-remote.n_tokens * 2 // CHUNK) + 2  # each shard's last chunk is its own
    assert ranged <= chunks + 1


def test_the_sampler_fetches_the_next_micro_batches_ahead_of_the_loader(s3, stores, tmp_path):
    from loom.data.mix import Mixture, SourceWindows
    from loom.data.sampler import ResumableDistributedSampler
    from loom.data.store.remote.blob import _pool

    _faults_off(s3)
    store = open_store(stores["url"], storage=_settings(s3, tmp_path / "cache"))
    waited = store.shards[0].blob.stats.snapshot()["wait_s"]  # this process's counters, earlier tests' reads
    mix = Mixture([SourceWindows(store, "web", 32, part="train")], [1], seed=5)
    sampler = ResumableDistributedSampler(mix, num_replicas=1, rank=0, micro_batch=4, seed=3, prefetch_ahead=3)
    it = iter(sampler)
    first = next(it)  # hands out micro batch 0; micro batches 0..3 are being fetched meanwhile
    assert isinstance(first, int)
    _, pending, _ = _pool()
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)
    blob = store.shards[0].blob
    wanted = set()
    for k in sampler._ids(0, 16).tolist():  # the first four micro batches' windows
        _, _, t = mix.locate(k)
        start = mix.sources[0].window(t) * 32
        for s in range(len(store.shards)):
            lo, hi = int(store._starts[s]), int(store._starts[s + 1])
            if lo <= start < hi:
                wanted.add((s, (start - lo) * 2 // CHUNK))
    assert wanted and all(store.shards[s].blob.cache.chunk_path(store.shards[s].blob.key, n).is_file()
                          for s, n in wanted), wanted
    assert blob.stats.snapshot()["wait_s"] == waited  # fetched ahead: no reader waited yet


def _fill(cache: ChunkCache, n: int, size: int = 1000, obj: str = "obj") -> None:
    for i in range(n):
        cache.get(obj, i, size, lambda i=i: bytes([i % 251]) * size)
        assert cache.used_bytes() <= cache.max_bytes


def test_the_cache_never_exceeds_its_cap_evicts_least_recent_and_never_a_chunk_being_read(tmp_path):
    stats = StorageCounters()
    cache = ChunkCache(tmp_path, 5000, stats)
    _fill(cache, 4)
    cache.get("obj", 0, 1000, lambda: pytest.fail("chunk 0 is cached"))  # chunk 0 is now the most recent
    _fill(cache, 2, obj="other")  # room for one more: chunk 1 (least recent) goes, then chunk 2
    assert cache.chunk_path("obj", 0).is_file() and not cache.chunk_path("obj", 1).is_file()
    assert stats.snapshot()["evictions"] >= 1 and cache.used_bytes() <= 5000
    # a reader holding chunk 3 (its shared lock) keeps it through any pressure: the rest goes first
    fd = open(cache.chunk_path("obj", 3), "rb")  # noqa: SIM115
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        _fill(cache, 6, obj="third")
        assert cache.chunk_path("obj", 3).is_file() and cache.used_bytes() <= 5000
    finally:
        fd.close()
    # nothing evictable: served uncached, still within the cap
    tight = ChunkCache(tmp_path / "tight", 500, stats)
    assert tight.get("big", 0, 1000, lambda: b"x" * 1000) == b"x" * 1000
    assert not tight.chunk_path("big", 0).exists() and stats.snapshot()["uncached"] == 1
    # a prepare's staging folder beside the chunks is not the cache's to count or evict
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "part-00000.bin").write_bytes(b"s" * 9000)
    _fill(cache, 2, obj="fourth")
    assert (tmp_path / "staging" / "part-00000.bin").stat().st_size == 9000 and cache.used_bytes() <= 5000
    # a restart reads what is there (the cache outlives the process)
    again = ChunkCache(tmp_path, 5000, StorageCounters())
    assert again.get("third", 5, 1000, lambda: pytest.fail("the newest chunk survives")) == bytes([5]) * 1000


def _read_all(url: str, settings: StorageSettings, env: dict, out) -> None:
    import os

    os.environ.update(env)
    store = open_store(url, storage=settings)
    out.put(hashlib.sha1(store.read(0, store.n_tokens).tobytes()).hexdigest())


def test_two_processes_on_one_node_download_each_chunk_once(s3, stores, tmp_path):
    """Two ranks' worth of readers (spawned processes) read the whole store at once through one
    cache folder: one ranged GET per chunk between them, and both get the store's bytes."""
    _faults_off(s3)
    s3.faults.latency_s = 0.02  # so that the two overlap
    settings = _settings(s3, tmp_path / "node")
    before = s3.faults.ranged
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(stores["url"], settings, s3.env(), out)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        digests = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
    finally:
        _faults_off(s3)
    local = open_store(stores["local"])
    assert digests == [hashlib.sha1(local.read(0, local.n_tokens).tobytes()).hexdigest()] * 2
    chunks = sum(-(-s.n_tokens * 2 // CHUNK) for s in local.shards)
    assert s3.faults.ranged - before == chunks


def test_throttling_dropped_connections_and_slow_answers_are_retried(s3, stores, tmp_path):
    _faults_off(s3)
    local = open_store(stores["local"])
    settings = _settings(s3, tmp_path / "cache", timeout_s=1.0)
    store = open_store(stores["url"], storage=settings)
    stats = store.shards[0].blob.stats
    retried = stats.snapshot()["retries"]
    s3.faults.fail_next, s3.faults.drop_next = 3, 2
    assert np.array_equal(store.read(0, 5000), local.read(0, 5000))
    assert stats.snapshot()["retries"] - retried >= 5
    s3.faults.latency_s = 1.5  # past the request timeout: timed out, retried (the budget is 20 s)
    done = {}

    def cure() -> None:
        time.sleep(2.5)
        s3.faults.latency_s = 0.0
        done["cured"] = True

    import threading

    threading.Thread(target=cure, daemon=True).start()
    try:
        assert np.array_equal(store.read(20000, 3000), local.read(20000, 3000))
    finally:
        _faults_off(s3)
    assert done.get("cured") and stats.snapshot()["retries"] - retried >= 6


def test_an_outage_past_the_retry_budget_stops_naming_the_object(s3, stores, tmp_path):
    _faults_off(s3)
    store = open_store(stores["url"], storage=_settings(s3, tmp_path / "cache", retry_s=1.5))
    s3.faults.down = True
    t0 = time.monotonic()
    try:
        with pytest.raises(StorageUnavailable) as e:
            store.read(store.n_tokens - 100, 100)
    finally:
        _faults_off(s3)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert f"{stores['url']}/part-00002.bin bytes" in msg and "dataset.storage.retry_s" in msg and "resumes" in msg


def test_short_corrupt_or_missing_objects_are_refused_as_a_local_store_would_be(s3, stores, tmp_path):
    _faults_off(s3)
    c = s3.client()
    base = "tok/bad"
    local = stores["local"]
    for f in local.iterdir():
        c.upload_file(str(f), "corpora", f"{base}/{f.name}")
    settings = _settings(s3, tmp_path / "cache")
    url = f"s3://corpora/{base}"
    c.put_object(Bucket="corpora", Key=f"{base}/part-00001.bin", Body=(local / "part-00001.bin").read_bytes()[:-6])
    with pytest.raises(StoreError, match="part-00001.bin: .* truncated"):
        open_store(url, storage=settings)
    c.upload_file(str(local / "part-00001.bin"), "corpora", f"{base}/part-00001.bin")
    idx = bytearray((local / "part-00002.idx").read_bytes())
    idx[-1] ^= 1
    c.put_object(Bucket="corpora", Key=f"{base}/part-00002.idx", Body=bytes(idx))
    with pytest.raises(StoreError, match="part-00002.idx: its SHA-256 differs"):
        open_store(url, storage=settings)
    c.delete_object(Bucket="corpora", Key=f"{base}/part-00002.idx")
    with pytest.raises(StoreError, match="lists 3 shards, but 1 lack"):
        open_store(url, storage=settings)
    with pytest.raises(StoreError, match="no token store at s3://corpora/tok/nothing"):
        open_store("s3://corpora/tok/nothing", storage=settings)
    c.put_object(Bucket="corpora", Key="tok/half/.prepare/plan.json", Body=b"{}")
    with pytest.raises(StoreError, match="interrupted `loom data prepare`"):
        open_store("s3://corpora/tok/half", storage=settings)


def test_a_megatron_prefix_and_a_flat_file_in_s3_read_as_on_disk(s3, stores, tmp_path):
    _faults_off(s3)
    local = stores["local"]
    settings = _settings(s3, tmp_path / "cache")
    prefix = open_store(f"{stores['url']}/part-00001", storage=settings)
    assert prefix.kind == "megatron" and prefix.n_docs == 40
    assert np.array_equal(prefix.read(0, prefix.n_tokens), open_store(local / "part-00001").read(0, prefix.n_tokens))
    flat = np.arange(3000, dtype=np.uint16)
    s3.client().put_object(Bucket="corpora", Key="flat/train.bin", Body=flat.tobytes())
    store = open_store("s3://corpora/flat/train.bin", storage=settings)
    assert store.kind == "flat" and np.array_equal(store.read(100, 2000), flat[100:2100])


@pytest.mark.parametrize("case", ["endpoint-secret", "cap", "chunk", "prefetch", "retry", "no-store"])
def test_bad_storage_settings_are_refused_before_launch(s3, stores, tmp_path, case):
    src = f"dataset.mix=[{stores['url']}]"
    args, needles = {
        "endpoint-secret": (["dataset.storage.endpoint_url=https://me:hunter2@minio:9000"],
                            ["dataset.storage.endpoint_url", "credentials never go in the config"]),
        "cap": (["dataset.cache.max_gb=0.01"], ["dataset.cache.max_gb", "fewer than 16 chunks"]),
        "chunk": (["dataset.cache.chunk_mb=0"], ["dataset.cache.chunk_mb", "[0.0625, 1024]"]),
        "prefetch": (["dataset.cache.prefetch=-1"], ["dataset.cache.prefetch", ">= 0"]),
        "retry": (["dataset.storage.retry_s=0"], ["dataset.storage.retry_s", "positive"]),
        "no-store": (["dataset.mix=[s3://corpora/tok/none]"], ["dataset.mix[0].path", "no token store at s3://"]),
    }[case]
    if case == "no-store":
        src = args.pop(0)
    err = refused(tmp_path, "dataset=tokens", "model=gpt_tiny", "dataset.seq_len=32", src,
                  f"dataset.cache.dir={tmp_path / 'cache'}", *args)
    for needle in needles:
        assert needle in err, err
    assert "hunter2" not in err


def test_storage_that_does_not_answer_at_launch_is_exit_1_naming_the_source(s3, stores, tmp_path):
    """An outage is not a bad config (exit 2): the same command may pass later, so exit 1, the
    source and the endpoint's error named, nothing written."""
    import contextlib
    import io

    from loom import cli

    err = io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["train", "dataset=tokens", "model=gpt_tiny", "dataset.seq_len=32", f"dataset.mix=[{stores['url']}]",
                       "dataset.storage.endpoint_url=http://127.0.0.1:9", "dataset.storage.retry_s=0.5",
                       "dataset.storage.timeout_s=0.5", f"dataset.cache.dir={tmp_path / 'cache'}",
                       f"run.root={tmp_path / 'runs'}"])
    text = err.getvalue()
    assert rc == 1 and "dataset.mix[0].path='s3://corpora/tok/web'" in text and "did not answer" in text, text
    assert not (tmp_path / "runs").exists()
