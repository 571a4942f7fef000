"""The data benchmark's remote leg (issue 54): the `wait` leg's gpt_small 2-rank run with its
store in object storage, a local S3 API (moto's server, tests/s3_helpers.py) behind a proxy
adding `latency_ms` to every request, read through a cold node cache, with prefetch on
(dataset.cache.prefetch=4) and off (0), side by side. moto itself answers in tens of ms a
request on this machine: the figures are an upper bound on what a real endpoint costs."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

from _bench import REPO, run_loom

sys.path.insert(0, str(REPO / "tests"))


def _wait(run_dir: Path) -> tuple[list[float], list[float], list[float]]:
    """Per log window after the first: data wait %, storage wait ms, step time ms."""
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/data_wait_pct")]
    rows = rows[1:]  # the first window holds the loader's start (and the first fetches)
    return ([float(r["perf/data_wait_pct"]) for r in rows], [float(r["perf/storage_wait_ms"]) for r in rows],
            [float(r["perf/step_time_ms"]) for r in rows])


def bench_remote(root: Path, steps: int, latency_ms: float = 50.0) -> dict:
    """gpt_small, 2 ranks, one 24 MB byte-level store in S3, 256 KB chunks: prefetch on vs off."""
    from s3_helpers import LocalS3

    from loom.data.options.tinycode import corpus_files
    from loom.data.prepare import file_doc_units, prepare

    prepare(file_doc_units(corpus_files(24_000_000)), root / "remote-src", None, workers=2, progress="none")
    s3 = LocalS3()
    saved = dict(os.environ)
    os.environ.update(s3.env())  # the runs inherit the endpoint and the fake credentials
    out: dict = {"latency_ms": latency_ms, "chunk_mb": 0.25}
    try:
        url = s3.bucket("bench") + "/tok/src"
        s3.upload_dir(root / "remote-src", url)
        s3.faults.latency_s = latency_ms / 1000
        for label, ahead in (("prefetch", 4), ("no_prefetch", 0)):
            gets = s3.faults.ranged
            s = run_loom(["model=gpt_small", "strategy=ddp", "hardware.devices=2", "dataset=tokens",
                          f"dataset.mix=['{url}']", f"dataset.cache.dir={root / f'cache-{label}'}",
                          "dataset.cache.chunk_mb=0.25", f"dataset.cache.prefetch={ahead}",
                          f"trainer.max_steps={steps}", "trainer.log_every_n_steps=5", "tracking=csv",
                          "checkpoint.every_n_steps=0", "trainer.limit_val_batches=1"], root, f"remote-{label}")
            pct, storage_ms, step_ms = _wait(Path(s["run_dir"]))
            out[label] = {"data_wait_pct_mean": sum(pct) / max(1, len(pct)), "data_wait_pct_max": max(pct),
                          "storage_wait_ms_mean": sum(storage_ms) / max(1, len(storage_ms)),
                          "step_time_ms_mean": sum(step_ms) / max(1, len(step_ms)),
                          "ranged_gets": s3.faults.ranged - gets,
                          "storage": s.get("storage"), "summary_data_wait": s.get("data_wait")}
    finally:
        s3.stop()
        os.environ.clear()
        os.environ.update(saved)
    return out


def verdict(r: dict) -> str:
    on, off = r["prefetch"], r["no_prefetch"]
    return (f"remote store, {r['latency_ms']:g} ms per request, a {on['step_time_ms_mean']:.0f} ms step: data wait "
            f"{on['data_wait_pct_mean']:.2f}% mean, "
            f"{on['data_wait_pct_max']:.2f}% max of the step with prefetch (target < 1%); without prefetch "
            f"{off['data_wait_pct_mean']:.2f}% mean, {off['data_wait_pct_max']:.2f}% max")
