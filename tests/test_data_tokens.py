"""`dataset=tokens`: prepared stores read by computed windows, mixed by weight, packed by
document; every bad input refused before launch (exit 2) or, where only a batch can tell, at
that batch naming the store and document. In-process: no launches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import refused

from loom.data.store import ShardWriter, write_sidecar
from loom.pipeline import resolve


def _store(d: Path, docs: list[np.ndarray], tokenizer: str | None = None, fingerprint: str = "bytes",
           vocab: int = 256, dtype=np.uint16, shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    names = [f"part-{i:05d}" for i in range(shards)]
    for i, name in enumerate(names):
        with ShardWriter(d / name, dtype) as w:
            for doc in docs[i::shards]:
                w.add_document(np.asarray(doc, dtype=dtype))
    write_sidecar(d, {"format": "loom-token-store", "version": 1, "shards": names, "tokenizer": tokenizer,
                      "tokenizer_fingerprint": fingerprint, "vocab_size": vocab, "dtype": np.dtype(dtype).name,
                      "tokens": sum(len(x) for x in docs), "documents": len(docs)})
    return d


def _docs(seed: int, n: int, lo: int = 5, hi: int = 90, top: int = 250) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, top, size=int(rng.integers(lo, hi))) for _ in range(n)]


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory) -> tuple[Path, Path, list, list]:
    root = tmp_path_factory.mktemp("stores")
    web, code = _docs(1, 120), _docs(2, 30)
    return _store(root / "web", web, shards=3), _store(root / "code", code), web, code


def _cfg(*extra: str):
    return resolve(["dataset=tokens", "model=gpt_tiny", "dataset.seq_len=32", "dataset.batch_size=2", *extra])


def _mix(a: Path, b: Path, wa: float = 0.7, wb: float = 0.3) -> str:
    return f"dataset.mix=[{{path: {a}, weight: {wa}}}, {{path: {b}, weight: {wb}}}]"


def test_windows_are_the_stores_tokens_and_the_mixture_keeps_its_weights(two_stores):
    from loom.data.options.tokens import datasets

    web, code, web_docs, code_docs = two_stores
    train, val = datasets(_cfg(_mix(web, code), "dataset.val_fraction=0.1"))
    streams = {"web": np.concatenate(web_docs[0::3] + web_docs[1::3] + web_docs[2::3]),
               "code": np.concatenate(code_docs)}
    drawn = {"web": 0, "code": 0}
    for k in range(400):  # several epochs of the small source: it repeats, counted
        j, epoch, t = train.locate(k)
        src = train.sources[j]
        x, y = train[k]
        w = src.holdout.train_window(t)
        want = streams[src.name][w * 32: w * 32 + 33]
        assert x.tolist() == want[:-1].tolist() and y.tolist() == want[1:].tolist()
        drawn[src.name] += 1
        assert abs(drawn["web"] - 0.7 * (k + 1)) <= 1 and abs(drawn["code"] - 0.3 * (k + 1)) <= 1
    report = train.consumed(400)
    assert report["web"]["samples"] == drawn["web"] and report["code"]["tokens"] == drawn["code"] * 32
    assert report["code"]["epochs"] > 1  # the small source repeated rather than ending the run
    assert [v.name for v in val] == ["web", "code"] and all(len(v) > 0 for v in val)
    held = {val[0].window(i) for i in range(len(val[0]))}
    trained = {train.sources[0].holdout.train_window(t) for t in range(len(train.sources[0]))}
    assert not held & trained  # validation is held out per source


def test_an_epoch_of_a_source_is_a_fresh_permutation_of_its_windows(two_stores):
    from loom.data.options.tokens import datasets

    web, code, *_ = two_stores
    train, _ = datasets(_cfg(_mix(web, code, 1, 1), "dataset.val_fraction=0"))
    n = len(train.sources[1])
    seen: dict[int, list[int]] = {}
    for k in range(8 * n):
        j, epoch, t = train.locate(k)
        if j == 1:
            seen.setdefault(epoch, []).append(t)
    full = [e for e, ts in seen.items() if len(ts) == n]
    assert len(full) >= 2 and all(sorted(seen[e]) == list(range(n)) for e in full)
    assert seen[full[0]] != seen[full[1]]


def test_documents_packing_restarts_positions_and_masks_crossing_targets(two_stores):
    from loom.data.options.tokens import datasets

    web, code, web_docs, _ = two_stores
    train, _ = datasets(_cfg(f"dataset.mix=[{web}]", "dataset.packing=documents", "dataset.val_fraction=0"))
    src = train.sources[0]
    order = web_docs[0::3] + web_docs[1::3] + web_docs[2::3]
    starts = np.cumsum([0] + [len(d) for d in order])
    for w in range(len(src)):
        b = src[w]
        y, pos = b.targets, b.positions
        assert b.masked
        for i in range(32):
            g = w * 32 + i
            doc = int(np.searchsorted(starts, g, side="right")) - 1
            assert pos[i] == min(g - starts[doc], i)
            crosses = (g + 1) in set(starts.tolist())
            assert (y[i] == -100) == crosses


def test_a_token_beyond_the_models_vocabulary_stops_naming_the_store_and_document(tmp_path):
    from loom.data.options.tokens import datasets

    docs = _docs(3, 20)
    docs[7][3] = 300
    store = _store(tmp_path / "wide", docs, fingerprint="other", vocab=256)
    train, _ = datasets(_cfg(f"dataset.mix=[{store}]", "dataset.val_fraction=0"))
    with pytest.raises(ValueError, match=r"token id 300 in document 7 .*outside the model's vocabulary of 256"):
        for k in range(len(train)):
            train[k]


def test_a_megatron_prefix_without_sidecar_trains_and_the_launch_line_says_so(tmp_path):
    from loom.data.describe import summary_line
    from loom.data.options.tokens import datasets

    with ShardWriter(tmp_path / "my_text_document", np.uint16) as w:
        for d in _docs(4, 40):
            w.add_document(d.astype(np.uint16))
    cfg = _cfg(f"dataset.mix=[{tmp_path / 'my_text_document'}]")
    train, val = datasets(cfg)
    assert "no sidecar" in summary_line(cfg, train, val, 1) and len(train) > 0


def test_a_flat_nanogpt_bin_is_read_with_its_dtype(tmp_path):
    from loom.data.options.tokens import datasets

    tokens = np.arange(1000, dtype=np.uint32) % 250
    tokens.tofile(tmp_path / "train.bin")
    train, _ = datasets(_cfg(f"dataset.mix=[{tmp_path / 'train.bin'}]", "dataset.dtype=uint32",
                             "dataset.val_fraction=0"))
    x, y = train.sources[0][3]
    assert x.tolist() == tokens[96:128].tolist() and y.tolist() == tokens[97:129].tolist()


@pytest.mark.parametrize("case", ["weight", "unparsable", "nopath", "nostore", "truncated", "tokenizers",
                                  "packing", "small", "name"])
def test_bad_mixtures_are_refused_before_launch(case, tmp_path, two_stores):
    web, code, *_ = two_stores
    other = _store(tmp_path / "other", _docs(5, 30), tokenizer="gpt2", fingerprint="abc")
    broken = _store(tmp_path / "broken", _docs(6, 30))
    bin_file = broken / "part-00000.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-6])
    tiny = _store(tmp_path / "tiny", [np.arange(1, 10)])
    args, needles = {
        "weight": ([_mix(web, code, 0.7, -1)], ["dataset.mix[1].weight", "positive"]),
        "unparsable": ([_mix(web, code, 0.7, "lots")], ["dataset.mix[1].weight", "positive"]),
        "nopath": (["dataset.mix=[{weight: 1}]"], ["dataset.mix[0]", "path"]),
        "nostore": ([f"dataset.mix=[{tmp_path / 'nothing'}]"], ["dataset.mix[0].path", "nothing"]),
        "truncated": ([f"dataset.mix=[{broken}]"], ["dataset.mix[0].path", "part-00000.bin"]),
        "tokenizers": ([_mix(web, other)], ["dataset.mix", "different tokenizers", "gpt2"]),
        "packing": ([f"dataset.mix=[{web}]", "dataset.packing=rows"], ["dataset.packing", "concat, documents"]),
        "small": ([f"dataset.mix=[{tiny}]"], ["dataset.mix[0].path", "not one training window"]),
        "name": ([f"dataset.mix=[{web}, {web}]"], ["dataset.mix", "share a name"]),
    }[case]
    err = refused(tmp_path, "dataset=tokens", "model=gpt_tiny", "dataset.seq_len=32", *args)
    for needle in needles:
        assert needle in err, err


def test_a_token_file_among_text_files_is_refused_naming_dataset_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    (np.arange(600, dtype=np.uint16)).tofile(tmp_path / "train.bin")
    err = refused(tmp_path, "dataset=text_files", f"dataset.paths=[{tmp_path}/*]")
    assert "train.bin" in err and "dataset=tokens" in err and "dataset.paths" in err


def test_the_plan_says_what_the_document_mask_saves(tmp_path):
    from loom import data
    from loom.pipeline import plan_run

    store = _store(tmp_path / "short", [np.arange(1, 9)] * 64)  # documents of 8 tokens in 32-token windows
    cfg = _cfg(f"dataset.mix=[{store}]", "dataset.packing=documents", "dataset.val_fraction=0")
    note = data.packing_note(cfg, 0.5)
    assert "documents of 8 tokens on average" in note and "about 25% of it" in note and "~38%" in note
    assert any(w.startswith("dataset.packing=documents") for w in plan_run(cfg, show=False).warnings)
    assert data.packing_note(_cfg(f"dataset.mix=[{store}]"), 0.5) is None  # concat: nothing to say
