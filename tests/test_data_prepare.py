"""`loom data prepare` / `loom data inspect`: every input format round-trips to the ids
tests_helpers.Encoder gives, the output does not depend on --workers, an interrupted prepare
resumes redoing only what is missing, bad input is refused (exit 2, no store), and the `data`
verbs never import torch. In-process except the torch check and one CLI run; no training."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tests_helpers import CORPUS, Encoder, make_tokenizer

from loom.cli import main
from loom.data.prepare import (
    file_doc_units,
    hf_row_units,
    prepare,
    tokenizer_fingerprint,
    units_for_inputs,
)
from loom.data.prepare.progress import Progress
from loom.data.prepare.scan import line_cuts
from loom.data.store import SIDECAR, ShardWriter, open_store

DOCS = [f"{i}: " + CORPUS[i % len(CORPUS)] + ("\nsecond line, ünïcode ✓" if i % 3 == 0 else "")
        for i in range(40)]
MB = 1 << 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    return str(make_tokenizer(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture(scope="module")
def encoder(tok) -> Encoder:
    return Encoder(tok)


def _zst(path: Path, data: bytes) -> Path:
    import pyarrow as pa

    with pa.CompressedOutputStream(str(path), "zstd") as f:
        f.write(data)
    return path


def _jsonl(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


def _csv(path: Path, docs: list[str]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerows([i, d] for i, d in enumerate(docs))
    return path


def _parquet(path: Path, docs: list[str], rows_per_group: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), str(path), row_group_size=rows_per_group)
    return path


def _docs_of(store_dir: Path) -> list[np.ndarray]:
    """The store's documents (each shard's sequence lengths over the tokens read back)."""
    store = open_store(store_dir)
    flat = store.read(0, store.n_tokens)
    lengths = np.concatenate([s.lengths for s in store.shards]) if store.shards else np.zeros(0, int)
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []


def _expect(store_dir: Path, docs: list[str], encoder: Encoder) -> None:
    got = _docs_of(store_dir)
    want = encoder.encode_batch(docs)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def _old_key(name: str, encoder: Encoder) -> str:
    """The token cache's key before stores (Encoder.key): stores keep it."""
    import hashlib

    return hashlib.sha1(repr((name, sorted(encoder.tok.get_vocab().items()))).encode()).hexdigest()[:12]


def _make_input(kind: str, d: Path) -> tuple[list[str], list[str]]:
    """(inputs, the documents they hold in order) for one input format."""
    d.mkdir(parents=True)
    if kind == "text":
        for i, doc in enumerate(DOCS[:12]):
            name = d / f"doc{i:02d}.{['txt', 'py', 'md'][i % 3]}"
            data = doc.encode()
            if i % 4 == 1:
                gzip.open(f"{name}.gz", "wb").write(data)
            elif i % 4 == 2:
                _zst(Path(f"{name}.zst"), data)
            else:
                name.write_bytes(data)
        return [str(d / "**" / "*")], DOCS[:12]
    if kind == "jsonl":
        (d / "a.jsonl").write_bytes(_jsonl(DOCS[:15]))
        (d / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS[15:30])))
        _zst(d / "c.json.zst", _jsonl(DOCS[30:]))
        return [str(d / "*")], DOCS
    if kind == "csv":
        _csv(d / "a.csv", DOCS[:20])
        (d / "b.csv.gz").write_bytes(gzip.compress(_csv(d / "tmp.csv", DOCS[20:]).read_bytes()))
        (d / "tmp.csv").unlink()
        return [str(d / "a.csv"), str(d / "b.csv.gz")], DOCS
    if kind == "parquet":
        _parquet(d / "a.parquet", DOCS)
        return [str(d / "a.parquet")], DOCS
    import datasets

    train = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    datasets.DatasetDict({"test": train.select(range(3)), "train": train}).save_to_disk(str(d / "saved"))
    return [str(d / "saved")], DOCS


@pytest.mark.parametrize("kind", ["text", "jsonl", "csv", "parquet", "hf"])
def test_every_format_round_trips_to_the_encoders_ids(tmp_path, tok, encoder, kind):
    inputs, docs = _make_input(kind, tmp_path / "in")
    units = units_for_inputs(inputs, "text", 600)  # small units: lines cut, row groups grouped
    sc = prepare(units, tmp_path / "out", tok, workers=1, progress="none")
    _expect(tmp_path / "out", docs, encoder)
    assert sc["documents"] == len(docs) and sc["tokenizer_fingerprint"] == _old_key(tok, encoder) == \
        tokenizer_fingerprint(tok)
    assert (sc["dtype"], sc["vocab_size"], sc["eos_id"]) == ("uint16", 300, encoder.tok.eos_token_id)
    assert not (tmp_path / "out" / ".prepare").exists() and len(sc["shards"]) == len(units)
    if kind in ("jsonl", "csv", "parquet"):
        assert len(units) > len(inputs)  # the uncompressed file was cut
    if kind in ("jsonl", "csv"):  # and so were the .gz and .zst ones (each was one unit): ranges of their text
        for path in [p for p in sorted({u.paths[0] for u in units}) if p.endswith((".gz", ".zst"))]:
            ranges = [(u.start, u.stop, u.bytes) for u in units if u.paths[0] == path]
            text = gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else None
            assert len(ranges) > 2 and all(b - a == n for a, b, n in ranges), ranges
            assert [a for a, _, _ in ranges[1:]] == [b for _, b, _ in ranges[:-1]] and ranges[0][0] == 0
            assert text is None or (ranges[-1][1] == len(text) and all(text[a - 1:a] == b"\n" for a, _, _ in ranges[1:]))


def test_byte_level_and_empty_documents(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(["héllo", "", "world"]) + b'{"id": 9}\n\n')
    sc = prepare(units_for_inputs([str(d / "a.jsonl")], "text", MB), tmp_path / "out", None, workers=1,
                 progress="none")
    _expect(tmp_path / "out", ["héllo", "world"], Encoder(None))
    assert (sc["empty_skipped"], sc["documents"], sc["dtype"], sc["tokenizer"], sc["tokenizer_fingerprint"]) == \
        (2, 2, "uint8", None, "bytes")


def test_csv_cut_only_outside_quoted_newlines(tmp_path):
    docs = [f"line {i}\n" * (i % 4) + '"q"' + "x" * 30 for i in range(60)]
    path = _csv(tmp_path / "a.csv", docs)
    cuts, size = line_cuts(path, 100, quoted=True)
    data = path.read_bytes()
    assert len(cuts) > 5 and size == len(data)
    for c in cuts:  # each cut starts a record: an even number of quotes before it
        assert data[c - 1:c] == b"\n" and data[:c].count(b'"') % 2 == 0
    units = units_for_inputs([str(path)], "text", 100)
    prepare(units, tmp_path / "out", None, workers=1, progress="none")
    _expect(tmp_path / "out", [d for d in docs if d], Encoder(None))


def _legacy_sp_tokenizer(dest: Path) -> str:
    """A BPE as transformers converts a legacy sentencepiece one (Llama 2's tokenizer.json: a "▁"
    prepended to each text it encodes, spaces as "▁", no pre-tokenizer), which no cut leaves unchanged."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>").save_pretrained(str(dest))
    return str(dest)


def _long_doc(chars: int) -> str:
    """Text of CORPUS lines with runs of spaces, newlines and non-ASCII between them."""
    parts, n, i = [], 0, 0
    while n < chars:
        part = CORPUS[i % len(CORPUS)] + ["\n", "  ", "\n\n", " ✓ ", "\t"][i % 5]
        parts.append(part)
        n, i = n + len(part), i + 1
    return "".join(parts)[:chars]


def test_a_long_document_is_tokenized_in_pieces_with_one_calls_ids(tmp_path, tok, encoder, capsys):
    """Tokenizer memory grows faster than a document (one of 12.7 MB took a worker to 3.55 GB): a
    document over 1 M characters is cut where its tokens do not change, checked, and its ids equal
    one call's, in pieces of any size; a tokenizer that no cut leaves unchanged (legacy sentencepiece)
    has its document refused above --max-doc-mb, naming it (exit 2), and tokenized whole below it."""
    from loom.data.prepare.encoding import DocEncoder, token_spec
    from loom.data.prepare.pieces import PIECE_CHARS, encode_long

    doc = _long_doc(PIECE_CHARS * 5 // 4)
    enc = DocEncoder(token_spec(tok))
    whole = enc.ids(doc)
    for piece in (3_000, 50_000):
        assert encode_long(enc.ids, doc[:400_000], 0, piece=piece) == enc.ids(doc[:400_000])
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(["short one", doc, "after it"]))
    assert main(["data", "prepare", str(d / "a.jsonl"), "--out", str(tmp_path / "out"), "--tokenizer", tok,
                 "--workers", "1", "--max-doc-mb", "0.5"]) == 0
    got = _docs_of(tmp_path / "out")
    assert [len(a) for a in got] == [len(x) for x in encoder.encode_batch(["short one", doc, "after it"])]
    assert got[1].tolist() == whole + [encoder.tok.eos_token_id]

    meta = _legacy_sp_tokenizer(tmp_path / "meta")
    args = ["data", "prepare", str(d / "a.jsonl"), "--out", str(tmp_path / "m"), "--tokenizer", meta, "--workers", "1"]
    assert main([*args, "--max-doc-mb", "1"]) == 2
    err = capsys.readouterr().err
    first = len(_jsonl(["short one"]))
    assert f"the document {d / 'a.jsonl'} at byte {first} has 1.3 M characters and no place to cut" in err, err
    assert "--max-doc-mb 2" in err and "kept" in err and "Traceback" not in err
    assert main([*args, "--max-doc-mb", "2"]) == 0  # resumed: the plan does not hold the limit
    menc = DocEncoder(token_spec(meta))
    assert _docs_of(tmp_path / "m")[1].tolist() == menc.ids(doc) + [menc.eos[0]]


def test_progress_is_reported_while_a_unit_runs_and_kept_shards_apart(tmp_path, tok, monkeypatch):
    """Lines came only when a unit finished (5 lines in 11.5 minutes) and counted compressed bytes:
    a running unit reports the text it has read (a .gz's text, to the unit's size) through the
    pool's queue, Progress shows it every 10 s, and says apart what an earlier run kept."""
    import queue

    from loom.data.prepare import run, worker

    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS * 5)))
    [unit] = units_for_inputs([str(tmp_path / "a.jsonl.gz")], "text", 10 * MB)
    assert unit.bytes == len(_jsonl(DOCS * 5))  # the text, not the file's 3x smaller size
    text = _jsonl(DOCS * 2000)  # ~12 MB: the default unit size is a 64th of the text, not of the 40x smaller file
    _zst(tmp_path / "b.jsonl.zst", text)
    units = units_for_inputs([str(tmp_path / "b.jsonl.zst")], "text")
    assert len(units) == len(text) // MB + 1 and sum(u.bytes for u in units) == len(text)  # 11 of ~1 MB and the rest
    assert all(MB <= u.bytes < MB + 2000 for u in units[:-1]), [u.bytes for u in units]
    monkeypatch.setattr(worker, "REPORT_S", 0.0)
    monkeypatch.setattr(worker, "BATCH_DOCS", 7)
    q: queue.Queue = queue.Queue()
    monkeypatch.setattr(worker, "_queue", q)
    spec = run.token_spec(tok)
    stats = worker.run_unit(0, unit, str(tmp_path / "out"), ".prepare", spec, False)
    reports: list[tuple] = []
    run._drain(q, reports.append)
    read = [r[1] for r in reports]
    assert len(reports) == 200 and read == sorted(read) and 0 < read[0] < read[-1] <= unit.bytes
    assert reports[-1][2] == 200 and 0 < reports[-1][3] <= stats["tokens"]

    lines: list[str] = []
    p = Progress(3, 3_000_000_000, "lines", lines.append, every_s=0)
    p.add({"unit": 0, "documents": 10, "tokens": 100, "bytes": 1_000_000_000}, kept=True)
    p.partial((1, 500_000_000, 5, 50))
    assert lines[-1].startswith("prepare: 1/3 units (1 kept from an earlier run), 15 docs, 0.50 of 2.00 GB of new "
                                "text, ") and "150 tokens" in lines[-1]
    p.add({"unit": 1, "documents": 6, "tokens": 60, "bytes": 1_000_000_000})
    p.partial((1, 900_000_000, 5, 50))  # a late report of a finished unit changes nothing
    assert "2/3 units (1 kept from an earlier run), 16 docs, 1.00 of 2.00 GB" in p.line()


def test_workers_do_not_change_the_bytes(tmp_path, tok):
    inputs, _ = _make_input("jsonl", tmp_path / "in")
    for i in range(6):
        (tmp_path / "in" / f"t{i}.txt").write_text(DOCS[i] * 20)
    units = units_for_inputs(inputs, "text", 500)
    prepare(units, tmp_path / "w1", tok, workers=1, progress="none")
    lines: list[str] = []
    prepare(units, tmp_path / "w2", tok, workers=2, progress="lines", log=lines.append)
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "w2").iterdir()) and len(names) > 5
    assert all((tmp_path / "w1" / n).read_bytes() == (tmp_path / "w2" / n).read_bytes() for n in names)
    assert lines[-1].startswith(f"prepare: {len(units)}/{len(units)} units, ") and "ETA" in lines[-1]


def test_interrupted_prepare_resumes_only_the_missing_shard(tmp_path, tok, capsys):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(8):  # equal sizes: two files a unit, f5 in unit 2
        (d / f"f{i}.txt").write_text(f"file {i}: " + "lorem ipsum ✓ " * 50)
    bad = d / "f5.txt"
    good = bad.read_bytes()
    bad.write_bytes(b"ok \xff bad" + good[8:])  # same size: the plan still matches once fixed
    args = ["data", "prepare", str(d / "*.txt"), "--out", str(tmp_path / "out"), "--tokenizer", tok,
            "--shard-mb", str(len(good) * 2 / MB), "--workers", "1", "--strict"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad} at byte 3 is not UTF-8" in err and "--strict" in err
    out = tmp_path / "out"
    assert not (out / SIDECAR).exists() and (out / ".prepare" / "plan.json").is_file()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}
    assert sorted(kept) == ["part-00000.bin", "part-00000.idx", "part-00001.bin", "part-00001.idx"]
    assert main(["data", "inspect", str(out)]) == 2 and "interrupted" in capsys.readouterr().err
    other = [a if a != tok else str(tmp_path / "nope") for a in args]
    assert main([*args[:5], *args[7:]]) == 2  # no --tokenizer: another plan
    assert "--tokenizer" in (msg := capsys.readouterr().err) and "new --out" in msg
    assert main(other) == 2 and "no such tokenizer" in capsys.readouterr().err
    bad.write_bytes(good)
    assert main(args) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-0000[01].*")} == kept
    assert main([*args[:4], str(tmp_path / "clean"), *args[5:]]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "clean").iterdir()) and ".prepare" not in names
    assert all((out / n).read_bytes() == (tmp_path / "clean" / n).read_bytes() for n in names if n != SIDECAR)
    assert json.loads((out / SIDECAR).read_text())["shards"] == [f"part-{i:05d}" for i in range(4)]


def test_not_utf8_is_counted_or_refused(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(["one"]) + b'{"text": "t\xe9"}\n' + _jsonl(["two"]) +
                                b'{"text": "\\ud800"}\n')
    (d / "b.txt").write_bytes(b"\x80abc")
    (d / "c.txt").write_text("fine")
    lines: list[str] = []
    sc = prepare(units_for_inputs([str(d / "*")], "text", MB), tmp_path / "out", None, workers=1,
                 progress="none", log=lines.append)
    assert (sc["not_utf8"], sc["documents"]) == (3, 3)
    at = len(_jsonl(["one"])) + len(b'{"text": "t')  # the offending byte itself
    assert "3 document(s) not UTF-8" in lines[-1] and f"{d / 'a.jsonl'} at byte {at}" in lines[-1]
    args = ["data", "prepare", str(d / "*"), "--out", str(tmp_path / "s"), "--strict"]
    assert main([*args, "--workers", "1"]) == 2
    assert f"{d / 'a.jsonl'} at byte {at} is not UTF-8" in capsys.readouterr().err
    assert main([*args, "--workers", "2"]) == 2  # a pool stops at the first refused unit
    assert "is not UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "s" / SIDECAR).exists()


def test_bad_inputs_exit_2_and_leave_no_store(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(["x"], field="content"))
    _csv(d / "a.csv", ["x"])
    _parquet(d / "a.parquet", ["x"])
    (d / "notes.txt").write_text("hi")
    (d / "bad.jsonl").write_text("not json\n")
    out = str(tmp_path / "out")
    cases = [
        ([str(d / "*.nothing")], "matches no file"),
        ([str(d / "a.jsonl")], f"--field text: {d / 'a.jsonl'} has no such field; its fields: id, content"),
        ([str(d / "a.csv"), "--field", "body"], "has no such column; its columns: id, text"),
        ([str(d / "a.parquet"), "--field", "body"], f"{d / 'a.parquet'} has no such column"),
        ([str(d / "bad.jsonl")], "is not JSON lines"),
        ([str(d)], "is a directory but not a Hugging Face dataset"),
        ([str(d / "notes.txt"), "--tokenizer", str(tmp_path / "missing_tok")], "no such tokenizer"),
    ]
    for extra, message in cases:
        assert main(["data", "prepare", *extra, "--out", out]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
        assert not Path(out, SIDECAR).exists()
    assert main(["data", "prepare", str(d / "notes.txt"), "--out", out]) == 0
    capsys.readouterr()
    assert main(["data", "prepare", str(d / "notes.txt"), "--out", out]) == 2
    assert "already a complete token store" in (err := capsys.readouterr().err) and "delete" in err
    assert main(["data", "prepare", str(d / "notes.txt"), "--out", str(d)]) == 2
    assert "neither empty nor an interrupted prepare" in capsys.readouterr().err


def test_inspect_a_store_and_a_megatron_prefix(tmp_path, tok, capsys):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(_jsonl(DOCS))
    assert main(["data", "prepare", str(d / "a.jsonl"), "--out", str(tmp_path / "s"), "--tokenizer", tok,
                 "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    sc = json.loads((tmp_path / "s" / SIDECAR).read_text())
    for want in (f"loom store {tmp_path / 's'}: 1 shard, 40 documents", f"tokenizer: {tok}", "vocab: 300, EOS id: 1",
                 f"mean document length: {sc['tokens'] / 40:,.1f} tokens", "shards (1): part-00000",
                 f"sources (1): {d / 'a.jsonl'} ({(d / 'a.jsonl').stat().st_size:,} bytes)"):
        assert want in text, text
    (tmp_path / "mg").mkdir(exist_ok=True)
    with ShardWriter(tmp_path / "mg" / "my_text_document", np.uint16) as w:
        for n in (3, 5):
            w.add_document(np.arange(n, dtype=np.uint16))
    assert main(["data", "inspect", str(tmp_path / "mg" / "my_text_document")]) == 0
    text = capsys.readouterr().out
    assert "megatron store" in text and "no sidecar" in text and "mean document length: 4.0 tokens" in text
    assert main(["data", "inspect", str(tmp_path / "nothing")]) == 2 and "no token store" in capsys.readouterr().err


def test_front_end_units_match_todays_token_files(tmp_path, tok, encoder):
    files = []
    for i in range(5):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(DOCS[i])
    prepare(file_doc_units(files, shard_bytes=100), tmp_path / "files", tok, workers=1, progress="none")
    _expect(tmp_path / "files", DOCS[:5], encoder)
    import datasets

    from loom.data.prepare.hf_source import docs as hf_docs

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": [*DOCS[:9], None, *DOCS[9:20]]}).save_to_disk(str(saved))
    spec = {"path": str(saved), "hub": None, "config": None, "split": "train", "cache_dir": None}
    for want_val in (False, True):
        units = hf_row_units(spec, "content", 21, val_every=4, want_val=want_val, max_docs=18, rows_per_unit=5)
        sc = prepare(units, tmp_path / f"hf{want_val}", tok, workers=1, progress="none")
        want = list(hf_docs(datasets.load_from_disk(str(saved)), "content", 4, want_val, 18))
        _expect(tmp_path / f"hf{want_val}", want, encoder)
        assert len(units) == 4 and sc["sources"] == [{"path": str(saved), "bytes": None}]


def test_progress_lines_are_rate_limited():
    lines: list[str] = []
    p = Progress(3, 3_000_000_000, "lines", lines.append, every_s=3600)
    p.add({"unit": 0, "documents": 1_234_567, "tokens": 2_345_678, "bytes": 1_000_000_000})
    assert lines == []
    p.close()
    assert lines[0].startswith("prepare: 1/3 units, 1,234,567 docs, 1.00 of 3.00 GB of text, ")
    assert "2,345,678 tokens, ETA " in lines[0]


def test_data_verbs_never_import_torch(tmp_path, tok):
    (tmp_path / "a.txt").write_text("hello")
    code = ("import sys; from loom.cli import main; "
            f"rc = main(['data', 'prepare', {str(tmp_path / 'a.txt')!r}, '--out', {str(tmp_path / 's')!r}, "
            f"'--tokenizer', {tok!r}, '--workers', '1']); "
            f"rc2 = main(['data', 'inspect', {str(tmp_path / 's')!r}]); "
            "bad = [m for m in ('torch', 'transformers', 'lightning') if m in sys.modules]; "
            "print('BAD', bad) if bad else None; sys.exit(rc or rc2 or len(bad))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrote " in r.stdout and "loom store" in r.stdout


def test_an_input_that_yields_no_token_is_refused_naming_it(tmp_path, capsys):
    """A binary file in the glob (every byte not UTF-8: skipped, counted) made a 0-token store that
    exited 0; now exit 2 naming it, and the --out directory is gone. An empty file beside text passes."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "model.bin").write_bytes(bytes(range(128, 256)) * 64)
    (d / "empty.txt").write_text("")
    (d / "notes.txt").write_text("some text")
    out = tmp_path / "out"
    assert main(["data", "prepare", str(d / "*"), "--out", str(out), "--workers", "1", "--shard-mb", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert f"1 input(s) yield no token ({d / 'model.bin'})" in err and "nothing was written" in err, err
    assert err.strip().splitlines()[-1].startswith("Invalid input:") and "Traceback" not in err and not out.exists()
    assert main(["data", "prepare", str(d / "model.bin"), "--out", str(out)]) == 2
    assert "yield no token" in capsys.readouterr().err and not out.exists()
    assert main(["data", "prepare", str(d / "notes.txt"), str(d / "empty.txt"), "--out", str(out)]) == 0


def _prepare_args(tmp_path: Path, tok: str, files: int) -> tuple[list[str], Path]:
    """A 2-worker prepare of `files` text files of ~12 KB, one shard each (~0.1 s a shard)."""
    d = tmp_path / f"in{files}"
    d.mkdir()
    for i in range(files):
        (d / f"f{i:03d}.txt").write_text((f"file {i}: " + " ".join(CORPUS)) * 400)
    out = tmp_path / f"out{files}"
    return [sys.executable, "-m", "loom.cli", "data", "prepare", str(d / "*.txt"), "--out", str(out), "--tokenizer",
            tok, "--workers", "2", "--shard-mb", str((d / "f000.txt").stat().st_size / MB)], out


def _interrupt(args: list[str], ready: Callable[[subprocess.Popen], bool], after_s: float = 0.0) -> tuple[int, str]:
    """Start `args` as a terminal's foreground job, Ctrl-C it (SIGINT to the whole process group, as
    a terminal does) once `ready` holds, and return (exit code, stderr)."""
    import signal
    import time

    def foreground_job() -> None:
        """Ctrl-C's default action, as a terminal's foreground job has it: a suite started in the
        background (`.ci/run &`, nohup) passes SIGINT ignored to its children, and Python keeps an
        inherited SIG_IGN, so the prepare would never see the signal (the loaded CI runs' failure)."""
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=foreground_job)
    deadline = time.monotonic() + 300  # a guard only
    while not ready(p):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.002)
    time.sleep(after_s)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=300)
    return p.returncode, err


def test_ctrl_c_says_in_one_line_what_is_kept_and_how_to_resume(tmp_path, tok):
    """Ctrl-C of a 2-worker prepare: exit 130 and one line (kept / total shards, run again to
    resume), no worker's traceback, whether it comes while the workers start (a worker still
    importing printed its own KeyboardInterrupt traceback) or once a shard is done; the same
    command then finishes the store from the kept shards."""
    args, out = _prepare_args(tmp_path, tok, 48)
    workers_started = lambda p: len(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()) >= 3  # noqa: E731
    # 0.1 s into the workers' imports (measured: a traceback at 0.1 s before the fix, none at 0.3 s)
    rc, err = _interrupt(args, workers_started, after_s=0.1)  # the resource tracker and 2 workers exist
    assert rc == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, (rc, err)
    assert err.strip().splitlines()[-1].startswith("loom data prepare: stopped (Ctrl-C); "), err
    rc, err = _interrupt(args, lambda p: bool(list((out / ".prepare").glob("done/*.json"))))  # once a shard is done
    assert rc == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, (rc, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("loom data prepare: stopped (Ctrl-C); ") and "/48 shards kept in" in line, err
    kept = int(line.split("; ")[1].split("/")[0])
    assert kept >= 1 and len(list(out.glob("part-*.idx"))) >= kept
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and json.loads((out / SIDECAR).read_text())["shards"] == [
        f"part-{i:05d}" for i in range(48)], r.stderr
