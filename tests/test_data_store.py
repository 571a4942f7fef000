"""The token store (loom.data.store): Megatron's indexed format written and read without torch,
checked against megatron-core's own writer and reader in both directions, plus flat nanoGPT
files, every corruption's message, and that opening a 10^12-token store reads nothing whole.
In-process and fast; megatron-core (scripts/setup.sh) is the reference, imported once."""

from __future__ import annotations

import importlib.util
import os
import pickle
import struct
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from loom.data.store import (
    DTYPE_CODES,
    PREPARE_DIR,
    SIDECAR,
    ShardWriter,
    StoreError,
    open_store,
    optimal_dtype,
    read_sidecar,
    write_sidecar,
)

VOCAB = {np.uint8: 256, np.uint16: 65_000, np.int32: 200_000}


@pytest.fixture(scope="module")
def mg():
    """megatron.core's indexed_dataset module, the reference writer and reader (CPU-importable)."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (scripts/setup.sh installs it): the format's reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return _indexed_dataset_alone()
        except (ImportError, AttributeError):
            return importlib.import_module("megatron.core.datasets.indexed_dataset")


def _indexed_dataset_alone():
    """Load indexed_dataset.py by itself: megatron.core's __init__ imports its whole model stack
    (~8 s here) while the module takes only `log_single_rank` from megatron.core.utils. Its parent
    packages are stood in for while it loads, then dropped from sys.modules (the module keeps
    what it imported), so a later `import megatron.core` anywhere gets the real packages."""
    if "megatron.core" in sys.modules:
        return importlib.import_module("megatron.core.datasets.indexed_dataset")
    root = importlib.util.find_spec("megatron").submodule_search_locations[0]
    before = set(sys.modules)
    try:
        for name in ("megatron", "megatron.core", "megatron.core.datasets"):
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__path__ = [os.path.join(root, *name.split(".")[1:])]
        utils = sys.modules["megatron.core.utils"] = types.ModuleType("megatron.core.utils")
        utils.log_single_rank = importlib.import_module("megatron.core._rank_utils").log_single_rank
        return importlib.import_module("megatron.core.datasets.indexed_dataset")
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("megatron"):
                del sys.modules[name]


def make_docs(seed: int, n: int, dtype: type) -> list[np.ndarray]:
    """Random documents, with an empty one inside and one at the end."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB[dtype], rng.integers(1, 40)).astype(np.int64) for _ in range(n)]
    docs[n // 2] = docs[-1] = np.zeros(0, np.int64)
    return docs


def ours(prefix: Path, docs: list[np.ndarray], dtype: type) -> Path:
    with ShardWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def theirs(mg, prefix: Path, docs: list[np.ndarray], dtype: type) -> Path:
    b = mg.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        b.add_document(d, [len(d)])
    b.finalize(f"{prefix}.idx")
    return prefix


def check_stream(store, docs: list[np.ndarray]) -> None:
    """read / doc_starts / doc_at against brute force over the concatenated documents."""
    lengths = np.array([len(d) for d in docs])
    stream = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    owner = np.repeat(np.arange(len(docs)), lengths)
    n = len(stream)
    assert (store.n_tokens, store.n_docs) == (n, len(docs))
    assert store.read(0, n).dtype == store.dtype
    assert np.array_equal(store.read(0, n), stream)
    rng = np.random.default_rng(0)
    for s, e in [(0, n), (-1, n + 1), (5, 6), *[sorted(rng.integers(0, n, 2)) for _ in range(40)]]:
        s0, e0 = max(s, 0), min(e, n)
        assert np.array_equal(store.read(s0, e0 - s0), stream[s0:e0])
        want = np.unique(starts[(lengths > 0) & (starts > s) & (starts < e)])
        got = store.doc_starts(s, e)
        assert got.dtype == np.int64 and np.array_equal(got, want), (s, e)
    assert [store.doc_at(i) for i in range(n)] == owner.tolist()
    for bad in (lambda: store.read(n - 1, 2), lambda: store.doc_at(n), lambda: store.read(-1, 1)):
        pytest.raises(IndexError, bad)


# --- (1) byte-identical to megatron's IndexedDatasetBuilder --------------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_writer_is_byte_identical_to_megatron_builder(mg, tmp_path, dtype):
    docs = make_docs(1, 60, dtype)
    a, b = ours(tmp_path / "ours", docs, dtype), theirs(mg, tmp_path / "theirs", docs, dtype)
    for ext in (".idx", ".bin"):
        assert Path(f"{a}{ext}").read_bytes() == Path(f"{b}{ext}").read_bytes(), ext
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.bin", "ours.idx", "theirs.bin", "theirs.idx"]
    idx = Path(f"{a}.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00" and DTYPE_CODES[idx[17]] is dtype
    assert struct.unpack("<QQ", idx[18:34]) == (60, 61)


def test_optimal_dtype_follows_megatron_with_none_as_bytes(mg):
    assert optimal_dtype(None) == np.uint8
    for vocab in (256, 50_257, 65_499, 65_500, 128_256):
        assert optimal_dtype(vocab) == mg.DType.optimal_dtype(vocab)
    assert {c: np.dtype(t).name for c, t in DTYPE_CODES.items()} == {d.value: d.name for d in mg.DType}


# --- (2) both directions: megatron reads ours, we read megatron's ---------------------------------

def test_megatron_reads_our_store(mg, tmp_path):
    docs = make_docs(2, 50, np.uint16)
    ds = mg.IndexedDataset(str(ours(tmp_path / "s", docs, np.uint16)))
    assert len(ds) == 50 and ds.index.dtype == np.uint16
    assert np.array_equal(ds.document_indices, np.arange(51))
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    assert np.array_equal(ds.get(3, offset=2, length=4), docs[3][2:6])


def test_we_read_megatron_prefix_in_every_spelling(mg, tmp_path):
    docs = make_docs(3, 70, np.int32)
    prefix = theirs(mg, tmp_path / "my_text_document", docs, np.int32)
    for spelling in (prefix, f"{prefix}.idx", f"{prefix}.bin", str(prefix)):
        store = open_store(spelling)
        assert (store.kind, store.path, store.dtype, store.sidecar) == ("megatron", prefix, np.int32, None)
    check_stream(store, docs)
    assert store.describe() == (f"megatron store {prefix}: 1 shard, 70 documents, {store.n_tokens:,} tokens, "
                                "int32, no sidecar (written by another tool)")


def test_sentence_split_documents_count_whole_documents(mg, tmp_path):
    """Megatron with sentence splitting: several sequences per document, and a document with no
    sequence (an empty input); document starts are the documents', never the sentences'."""
    rng = np.random.default_rng(4)
    b = mg.IndexedDatasetBuilder(str(tmp_path / "split.bin"), dtype=np.uint16)
    docs = []
    for i in range(30):
        sentences = [] if i % 7 == 3 else [rng.integers(0, 9000, rng.integers(1, 9)) for _ in range(1 + i % 4)]
        for s in sentences:
            b.add_item(types.SimpleNamespace(numpy=lambda s=s: s))  # add_item calls .numpy(): no torch
        b.end_document()
        docs.append(np.concatenate(sentences) if sentences else np.zeros(0, np.int64))
    b.finalize(str(tmp_path / "split.idx"))
    store = open_store(tmp_path / "split")
    assert store.shards[0].n_seqs > 30
    check_stream(store, docs)


def test_loom_store_dir_follows_sidecar_order_across_shards(mg, tmp_path):
    """Shards by both writers, an empty one between, listed out of name order: one stream in
    the sidecar's order, reads and document starts crossing every boundary."""
    parts = [make_docs(s, 25, np.uint16) for s in (5, 6, 7)]
    ours(tmp_path / "b-0", parts[0], np.uint16)
    theirs(mg, tmp_path / "a-1", parts[1], np.uint16)
    ours(tmp_path / "empty", [], np.uint16)
    ours(tmp_path / "c-2", parts[2], np.uint16)
    write_sidecar(tmp_path, {"shards": ["b-0", "a-1", "empty", "c-2"], "tokenizer": {"name": "gpt2"}})
    store = open_store(tmp_path)
    assert store.kind == "loom" and [s.prefix.name for s in store.shards] == ["b-0", "a-1", "empty", "c-2"]
    assert store.sidecar == read_sidecar(tmp_path)
    check_stream(store, parts[0] + parts[1] + parts[2])
    edge = store.shards[0].n_tokens
    assert store.doc_starts(edge - 1, edge + 1).tolist() == [edge]
    assert np.array_equal(store.read(edge - 3, 6), np.concatenate(parts[0] + parts[1])[edge - 3:edge + 3])
    assert store.describe() == (f"loom store {tmp_path}: 4 shards, 75 documents, {store.n_tokens:,} tokens, "
                                "uint16, tokenizer gpt2")


def test_dir_of_megatron_prefixes_is_read_in_name_order(mg, tmp_path):
    docs = [make_docs(s, 20, np.uint16) for s in (8, 9)]
    theirs(mg, tmp_path / "part_01", docs[1], np.uint16)
    theirs(mg, tmp_path / "part_00", docs[0], np.uint16)
    store = open_store(tmp_path)
    assert (store.kind, [s.prefix.name for s in store.shards]) == ("megatron", ["part_00", "part_01"])
    check_stream(store, docs[0] + docs[1])


def test_store_pickles_as_paths_not_bytes(tmp_path):
    ours(tmp_path / "s", [np.arange(50_000) % 60_000], np.uint16)
    write_sidecar(tmp_path, {"shards": ["s"]})
    store = open_store(tmp_path)
    blob = pickle.dumps(store)
    back = pickle.loads(blob)
    assert len(blob) < 4096
    assert np.array_equal(back.read(49_990, 10), store.read(49_990, 10)) and back.n_tokens == 50_000


def test_writer_leaves_nothing_on_error_and_refuses_ids_that_do_not_fit(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "s", np.uint16) as w:
        w.add_document(np.arange(10))
        raise RuntimeError("tokenizer died")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="token id 65536 does not fit"), ShardWriter(tmp_path / "s", np.uint16) as w:
        w.add_document(np.array([1, 65_536]))
    with pytest.raises(ValueError, match="no code"):
        ShardWriter(tmp_path / "t", np.uint32)
    assert list(tmp_path.iterdir()) == []
    w = ShardWriter(tmp_path / "s", np.uint8)
    w.add_document([1, 2, 255])
    assert [p.suffix for p in tmp_path.iterdir()] == [".tmp"]  # no .bin or .idx before finish
    w.finish()
    assert (tmp_path / "s.bin").read_bytes() == bytes([1, 2, 255]) and w.n_docs == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]


def test_sidecar_round_trip_and_bad_json(tmp_path):
    assert read_sidecar(tmp_path) is None
    write_sidecar(tmp_path, {"shards": ["x"], "n": 3})
    assert read_sidecar(tmp_path) == {"shards": ["x"], "n": 3} and SIDECAR == "loom.json"
    (tmp_path / SIDECAR).write_text("{half")
    with pytest.raises(StoreError, match="sidecar cannot be read.*re-run `loom data prepare`") as e:
        read_sidecar(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / SIDECAR}: ")


# --- (3) every corruption: StoreError naming the file, what is wrong and the fix -----------------

def _patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


# how: (break the shard's .idx or .bin, which file the message names, phrases it must hold)
CORRUPTIONS = {
    "truncated bin": (lambda idx, bin_: os.truncate(bin_, 298), ".bin", ["298 bytes", "300 bytes", "truncated"]),
    "long bin": (lambda idx, bin_: os.truncate(bin_, 302), ".bin", ["302 bytes", "300 bytes", "too long"]),
    "truncated idx": (lambda idx, bin_: os.truncate(idx, 74), ".idx", ["74 bytes", "needs 82 bytes", "truncated"]),
    "header only": (lambda idx, bin_: os.truncate(idx, 20), ".idx", ["20 bytes", "34-byte header"]),
    "bad magic": (lambda idx, bin_: _patch(idx, 0, b"GPT2"), ".idx", ["not a Megatron index", "GPT2"]),
    "unknown dtype": (lambda idx, bin_: _patch(idx, 17, b"\x09"), ".idx", ["unknown dtype code 9", "8 uint16"]),
    "bad doc index": (lambda idx, bin_: _patch(idx, 74, struct.pack("<q", 5)), ".idx", ["from 0 to 5"]),
}


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_shard_is_refused_with_sizes_and_fix(tmp_path, how):
    p = ours(tmp_path / "s", [np.arange(100), np.arange(50)], np.uint16)
    corrupt, named, phrases = CORRUPTIONS[how]
    corrupt(Path(f"{p}.idx"), Path(f"{p}.bin"))
    with pytest.raises(StoreError) as e:
        open_store(p)
    for phrase in [f"{p}{named}", *phrases, "re-run `loom data prepare` or re-copy"]:
        assert phrase in str(e.value), (phrase, str(e.value))
    assert "\n" not in str(e.value)


def test_store_dir_problems_say_what_was_looked_for(tmp_path):
    cases = []
    interrupted = tmp_path / "interrupted"
    (interrupted / PREPARE_DIR).mkdir(parents=True)
    ours(interrupted / "shard-00000", [np.arange(5)], np.uint16)
    cases.append((interrupted, ["interrupted `loom data prepare`", "run the same prepare again to resume"]))
    cases.append((tmp_path / "nowhere", [f"no token store at {tmp_path / 'nowhere'}", "nowhere.idx", "prepare"]))
    empty = tmp_path / "emptydir"
    empty.mkdir()
    (empty / "train.bin").write_bytes(b"\0\0")
    cases.append((empty, [str(empty), "loom.json", "train.bin", "pass the file's path"]))
    lost = tmp_path / "lost"
    ours(lost / "a", [np.arange(5)], np.uint16)
    write_sidecar(lost, {"shards": ["a", "b"]})
    cases.append((lost, [str(lost), "lists 2 shards", "1 lack", "(b)", "re-copy the whole directory"]))
    mixed = tmp_path / "mixed"
    ours(mixed / "a", [np.arange(5)], np.uint16)
    ours(mixed / "b", [np.arange(5)], np.int32)
    cases.append((mixed, ["different token dtypes", "a: uint16", "b: int32"]))
    ours(tmp_path / "noidx", [np.arange(5)], np.uint16)
    os.unlink(tmp_path / "noidx.idx")
    cases.append((tmp_path / "noidx", ["noidx.bin but no noidx.idx", f"pass {tmp_path / 'noidx.bin'} itself"]))
    nobin = tmp_path / "nobin"
    ours(nobin / "x", [np.arange(5)], np.uint16)
    os.unlink(nobin / "x.bin")
    cases.append((nobin, [str(nobin / "x.bin"), "missing", "expects 10 bytes"]))
    for path, phrases in cases:
        with pytest.raises(StoreError) as e:
            open_store(path)
        for phrase in phrases:
            assert phrase in str(e.value), (path, phrase, str(e.value))


# --- (4) flat nanoGPT token files ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_flat_nanogpt_file(tmp_path, dtype):
    tokens = (np.arange(10_001) * 7919 % 50_000).astype(dtype)
    tokens.tofile(tmp_path / "train.bin")
    store = open_store(tmp_path / "train.bin", dtype=None if dtype == "uint16" else dtype)
    assert (store.kind, store.dtype, store.n_tokens, store.n_docs) == ("flat", np.dtype(dtype), 10_001, None)
    assert np.array_equal(store.read(0, 10_001), tokens) and np.array_equal(store.read(9_990, 11), tokens[-11:])
    assert store.doc_starts(0, 10_001).tolist() == [] and store.doc_at(10_000) == 0
    assert store.describe() == (f"flat store {tmp_path / 'train.bin'}: 1 shard, documents unknown (no index), "
                                f"10,001 tokens, {dtype}, no sidecar (written by another tool)")
    pytest.raises(IndexError, store.read, 10_000, 2)


def test_flat_file_with_a_partial_token_or_unknown_dtype_is_refused(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(StoreError, match=r"odd.bin: 7 bytes is not a whole number of uint16 tokens.*6 and 8"):
        open_store(tmp_path / "odd.bin")
    with pytest.raises(StoreError, match=r"7 bytes is not a whole number of uint32 tokens.*4 and 8"):
        open_store(tmp_path / "odd.bin", dtype="uint32")
    with pytest.raises(StoreError, match="dtype='int8' for a flat token file"):
        open_store(tmp_path / "odd.bin", dtype="int8")


# --- (5) huge stores open lazily ----------------------------------------------------------------

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sparse(path: Path, size: int) -> None:
    try:
        with open(path, "ab") as f:
            f.truncate(size)
    except OSError as e:
        pytest.skip(f"this filesystem cannot hold a sparse file of {size:,} bytes: {e}")


@LINUX
def test_trillion_token_store_opens_and_answers_by_offset(tmp_path):
    """10^6 documents of 10^6 uint16 tokens: a 20 MB index and a sparse 2 TB .bin; sizes are
    checked from the last entries, lookups land on the right document, nothing is read whole."""
    n, length = 1_000_000, 1_000_000
    with open(tmp_path / "big.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, n, n + 1))
        f.write(np.full(n, length, np.int32).data)
        f.write((np.arange(n, dtype=np.int64) * (2 * length)).data)
        f.write(np.arange(n + 1, dtype=np.int64).data)
    _sparse(tmp_path / "big.bin", 2 * n * length)
    before = _rss()
    store = open_store(tmp_path / "big")
    mid = n * length // 2
    assert (store.n_tokens, store.n_docs) == (10**12, n)
    assert store.doc_starts(mid - 10, mid + 10).tolist() == [mid]
    assert store.doc_starts(mid + 1, mid + length).tolist() == []
    assert store.doc_starts(mid - 1, mid + 2 * length + 1).tolist() == [mid, mid + length, mid + 2 * length]
    assert store.doc_at(10**12 - 1) == n - 1 and store.doc_at(mid + 5) == n // 2 and store.doc_at(mid - 1) == n // 2 - 1
    assert store.read(10**12 - 4096, 4096).tolist() == [0] * 4096
    assert _rss() - before < 64 * 2**20
    _sparse(tmp_path / "big.bin", 2 * n * length - 2)
    with pytest.raises(StoreError, match="1,999,999,999,998 bytes, but big.idx says 2,000,000,000,000 bytes"):
        open_store(tmp_path / "big")


@LINUX
def test_index_arrays_are_never_passed_over_whole(tmp_path):
    """A 1.1 GB sparse index (10^8 sequences, one document): open, doc_starts, doc_at and read
    must touch a few pages. One pass over the pointers (or np.searchsorted, which copies
    Megatron's unaligned arrays whole) would map 760 MB."""
    n, length = 100_000_000, 1_000_000
    with open(tmp_path / "sparse.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, n, 2))
        f.truncate(34 + 12 * n)
        f.seek(34 + 4 * (n - 1))
        f.write(struct.pack("<i", length))
        f.seek(34 + 12 * n)
        f.write(struct.pack("<qq", 0, n))
    _sparse(tmp_path / "sparse.bin", 2 * length)
    before = _rss()
    store = open_store(tmp_path / "sparse")
    assert (store.n_tokens, store.n_docs, store.shards[0].n_seqs) == (length, 1, n)
    assert store.doc_starts(0, length).tolist() == [] and store.doc_at(length - 1) == 0
    assert store.read(length - 3, 3).tolist() == [0, 0, 0]
    grown = _rss() - before
    assert grown < 32 * 2**20, f"open and lookups mapped {grown / 2**20:.0f} MB of a sparse index"
