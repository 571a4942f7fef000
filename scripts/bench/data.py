#!/usr/bin/env python
"""The data axis at scale (issue 37), measured side by side in one run:

  tokenize  `loom data prepare` MB/s with 1 and 2 workers against the tokenizer's own
            `encode_batch` over the same text in one single-threaded process (a BPE tokenizer
            trained here on the corpus: no download). Targets: 1 worker >= 0.9x encode_batch,
            2 workers >= 1.7x 1 worker (this machine has 2 cores).
  index     a 10^12-token store (a sparse .bin): seconds and RSS above the process's baseline
            until a rank's first batch, cold (index pages dropped from the page cache) and
            warm; beside it, what the list-per-sample design held at 10^10 tokens. Targets:
            < 0.3 GB, < 10 s cold, < 1 s warm.
  wait      `loom train` gpt_small, 2 ranks (ddp), dataset=tokens over a 3-source mixture:
            perf/data_wait_pct per log window. Target: < 1% of the step.
  remote    `wait` with the store in object storage (a local S3 API with 50 ms added per request,
            scripts/bench/_remote.py), cold cache, dataset.cache.prefetch=4 against 0. Target:
            data wait < 1% of the step with prefetch on; the figure without it shown beside.
  bigdoc    one 20 MB document (a JSON line): the peak RSS of `loom data prepare --workers 1`
            (in pieces, loom.data.prepare.pieces) against the tokenizer's one call on the same
            text, each in its own process, and whether the ids are the same. Target: prepare
            < 0.5 GB, the README's bound.

    .venv/bin/python scripts/bench/data.py [--only tokenize,index,wait,remote,bigdoc] [--mb 24] [--json PATH]

Nothing asserts a time; the last lines say which targets the figures meet.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import PY, REPO, bench_env, load, run_loom, write_json
from _remote import bench_remote, verdict

HERE = Path(__file__).resolve().parent
ENCODE = """
import json, os, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
docs = [json.loads(line)["text"] for line in open(sys.argv[2])]
encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
t0 = time.perf_counter()
for i in range(0, len(docs), 1000):
    encode(docs[i:i + 1000], add_special_tokens=False)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def corpus(dest: Path, mb: float) -> tuple[Path, int]:
    """JSON lines of the standard library's .py files, repeated up to `mb` MB of text."""
    from loom.data.options.tinycode import corpus_files

    files, size, n = corpus_files(10**9), 0, 0
    with open(dest, "w") as out:
        while size < mb * 1e6:
            f = files[n % len(files)]
            text = f.read_text(errors="replace")
            out.write(json.dumps({"text": text}) + "\n")
            size, n = size + len(text.encode()), n + 1
    return dest, size


def tokenizer(dest: Path, jsonl: Path) -> Path:
    """A byte-level BPE of 8,000 tokens trained on the corpus, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for _, line in zip(range(400), open(jsonl), strict=False)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(dest)
    return dest


def bench_tokenize(root: Path, mb: float) -> dict:
    jsonl, size = corpus(root / "corpus.jsonl", mb)
    tok = tokenizer(root / "tok", jsonl)
    env = {**bench_env(), "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out: dict = {"mb": size / 1e6}
    runs = []
    for rep in range(2):  # interleaved: drift in the machine's load hits every side alike
        p = subprocess.run([PY, "-c", ENCODE, str(tok), str(jsonl)], capture_output=True, text=True, env=env,
                           check=True)
        runs.append(("encode_batch", json.loads(p.stdout.splitlines()[-1])["seconds"]))
        for w in (1, 2):
            dest = root / f"store-{w}-{rep}"
            t0 = time.perf_counter()
            subprocess.run([PY, "-m", "loom.cli", "data", "prepare", str(jsonl), "--tokenizer", str(tok),
                            "--out", str(dest), "--workers", str(w)], capture_output=True, text=True,
                           env=bench_env(), check=True, cwd=root)
            runs.append((f"prepare_{w}", time.perf_counter() - t0))
    for name in ("encode_batch", "prepare_1", "prepare_2"):
        best = min(s for n, s in runs if n == name)
        out[f"{name}_mb_s"] = size / 1e6 / best
    same = (root / "store-1-0" / "part-00000.bin").read_bytes() == (root / "store-2-0" / "part-00000.bin").read_bytes()
    out["same_bytes_1_vs_2_workers"] = same
    out["ratio_1_worker_vs_encode_batch"] = out["prepare_1_mb_s"] / out["encode_batch_mb_s"]
    out["ratio_2_vs_1_workers"] = out["prepare_2_mb_s"] / out["prepare_1_mb_s"]
    return out


PEAK = """
import json, resource, sys
sys.argv = sys.argv[1:]
if sys.argv[0] == "one_call":
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
    ids = tok.encode_batch_fast([json.loads(open(sys.argv[2]).read())["text"]], add_special_tokens=False)[0].ids
    np.save(sys.argv[3], np.array(ids, dtype=np.uint16))
else:
    from loom.cli import main
    assert main(sys.argv) == 0
print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def bench_bigdoc(root: Path, mb: float = 20.0) -> dict:
    """Peak RSS of prepare (pieces) and of one tokenizer call over one `mb` MB document."""
    import numpy as np

    from loom.data.store import open_store

    jsonl, _ = corpus(root / "small.jsonl", 4)
    tok = tokenizer(root / "tok-big", jsonl)
    text = "\n".join(json.loads(line)["text"] for line in open(jsonl))
    while len(text) < mb * 1e6:
        text += "\n" + text
    doc = root / "bigdoc.jsonl"
    doc.write_text(json.dumps({"text": text[: int(mb * 1e6)]}) + "\n")
    run = lambda *args: json.loads(subprocess.run([PY, "-c", PEAK, *args], capture_output=True, text=True,  # noqa: E731
                                                  env=bench_env(), check=True).stdout.splitlines()[-1])
    t0 = time.perf_counter()
    prep = run("data", "prepare", str(doc), "--tokenizer", str(tok), "--out", str(root / "bigdoc"), "--workers", "1")
    prep_s, t0 = time.perf_counter() - t0, time.perf_counter()
    one = run("one_call", str(tok), str(doc), str(root / "one.npy"))
    one_s = time.perf_counter() - t0
    store = open_store(root / "bigdoc")
    got = store.read(0, store.n_tokens)
    same = bool(np.array_equal(got[:-1], np.load(root / "one.npy")))  # the store appends the EOS
    return {"doc_mb": mb, "prepare_peak_rss_gb": prep["peak_rss_gb"], "prepare_s": prep_s,
            "one_call_peak_rss_gb": one["peak_rss_gb"], "one_call_s": one_s, "same_ids": same}


def big_store(d: Path, docs: int = 10**6, doc_tokens: int = 10**6) -> Path:
    """A Megatron-format store of docs x doc_tokens uint16 tokens: a real index, a sparse .bin."""
    import numpy as np

    from loom.data.store import write_sidecar

    d.mkdir(parents=True, exist_ok=True)
    with open(d / "part-00000.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", docs) + struct.pack("<Q", docs + 1))
        f.write(np.full(docs, doc_tokens, np.int32).tobytes())
        f.write((np.arange(docs, dtype=np.int64) * doc_tokens * 2).tobytes())
        f.write(np.arange(docs + 1, dtype=np.int64).tobytes())
    with open(d / "part-00000.bin", "wb") as f:
        f.truncate(docs * doc_tokens * 2)
    write_sidecar(d, {"format": "loom-token-store", "version": 1, "shards": ["part-00000"], "tokenizer": None,
                      "tokenizer_fingerprint": "bytes", "vocab_size": 256, "dtype": "uint16",
                      "tokens": docs * doc_tokens, "documents": docs})
    return d


def _index_run(*args: str) -> dict:
    p = subprocess.run([PY, str(HERE / "data_index.py"), *args], capture_output=True, text=True,
                       env=bench_env(), check=True)
    return json.loads(p.stdout.splitlines()[-1])


def bench_index(root: Path) -> dict:
    store = big_store(root / "tera")
    cold = [_index_run("--store", str(store), "--cold") for _ in range(3)]
    warm = [_index_run("--store", str(store)) for _ in range(3)]
    legacy = _index_run("--legacy", str(10**10 // 2048))
    best = lambda runs, k: min(r[k] for r in runs)  # noqa: E731
    return {"tokens": 10**12, "windows": cold[0]["windows"], "cold_s": best(cold, "seconds"),
            "warm_s": best(warm, "seconds"), "rss_gb": max(r["rss_gb"] for r in cold + warm),
            "val_windows": cold[0].get("val_windows"), "val_evaluated": cold[0].get("val_evaluated"),
            "val_rss_gb": max(r.get("val_rss_gb") or 0.0 for r in cold + warm),
            "val_peak_rss_gb": max(r.get("val_peak_rss_gb") or 0.0 for r in cold + warm), "legacy_1e10_tokens": legacy}


def bench_wait(root: Path, steps: int) -> dict:
    """3 byte-level stores of standard library files, mixed 0.5 / 0.3 / 0.2, gpt_small, 2 ranks."""
    from loom.data.options.tinycode import corpus_files
    from loom.data.prepare import file_doc_units, prepare

    files = corpus_files(30_000_000)
    for i in range(3):
        prepare(file_doc_units(files[i::3]), root / f"src{i}", None, workers=2, progress="none")
    mix = ", ".join(f"{{path: {root / f'src{i}'}, weight: {w}}}" for i, w in enumerate((0.5, 0.3, 0.2)))
    s = run_loom(["model=gpt_small", "strategy=ddp", "hardware.devices=2", "dataset=tokens", f"dataset.mix=[{mix}]",
                  f"trainer.max_steps={steps}", "trainer.log_every_n_steps=5", "tracking=csv",
                  "checkpoint.every_n_steps=0", "trainer.limit_val_batches=1"], root, "wait")
    import csv

    with open(Path(s["run_dir"]) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/data_wait_pct")]
    pct = [float(r["perf/data_wait_pct"]) for r in rows][1:]  # the first window holds the loader's start
    return {"windows": len(pct), "data_wait_pct_mean": sum(pct) / max(1, len(pct)), "data_wait_pct_max": max(pct),
            "step_time_ms": s.get("step_time_ms"), "data": s.get("data"), "summary_data_wait": s.get("data_wait")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="tokenize,index,wait,bigdoc")
    ap.add_argument("--mb", type=float, default=24.0, help="tokenize: MB of text")
    ap.add_argument("--steps", type=int, default=40, help="wait: training steps")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out: dict = {"load": load()}
    with tempfile.TemporaryDirectory(prefix="loom-bench-data-") as tmp:
        for part in a.only.split(","):
            t0 = time.perf_counter()
            out[part] = {"tokenize": lambda: bench_tokenize(Path(tmp), a.mb), "index": lambda: bench_index(Path(tmp)),
                         "wait": lambda: bench_wait(Path(tmp), a.steps), "bigdoc": lambda: bench_bigdoc(Path(tmp)),
                         "remote": lambda: bench_remote(Path(tmp), a.steps)}[part]()
            print(f"{part} ({time.perf_counter() - t0:.0f} s): {json.dumps(out[part], default=str)}", flush=True)
    verdicts(out)
    write_json(a.json, out)


def verdicts(out: dict) -> None:
    t, i, w, b = out.get("tokenize"), out.get("index"), out.get("wait"), out.get("bigdoc")
    if t:
        print(f"1 worker vs encode_batch: {t['ratio_1_worker_vs_encode_batch']:.2f}x (target >= 0.9); "
              f"2 vs 1 workers: {t['ratio_2_vs_1_workers']:.2f}x (target >= 1.7); same bytes: "
              f"{t['same_bytes_1_vs_2_workers']}")
    if i:
        print(f"10^12 tokens: first batch {i['cold_s']:.2f} s cold (< 10), {i['warm_s']:.2f} s warm (< 1), "
              f"{i['rss_gb']:.3f} GB RSS (< 0.3); list-per-sample at 10^10: {i['legacy_1e10_tokens']['rss_gb']:.2f} GB")
    if w:
        print(f"data wait, gpt_small 2 ranks, 3 sources: {w['data_wait_pct_mean']:.2f}% mean, "
              f"{w['data_wait_pct_max']:.2f}% max of the step (target < 1%)")
    if out.get("remote"):
        print(verdict(out["remote"]))
    if b:
        print(f"one {b['doc_mb']:.0f} MB document: prepare peaks at {b['prepare_peak_rss_gb']:.2f} GB RSS (target < 0.5), "
              f"one tokenizer call at {b['one_call_peak_rss_gb']:.2f} GB; same ids: {b['same_ids']}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "platform"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
