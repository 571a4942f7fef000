"""`loom data prepare --out s3://...`: against moto's S3 server behind the fault proxy
(tests/s3_helpers). The uploaded store reads the same tokens as the local one, the sidecar goes
last, an interrupted or cut-off prepare leaves no store and resumes redoing only the units not
uploaded (from a fresh staging folder too), another plan, a complete store or a foreign prefix is
refused naming the URL, a big shard goes up multipart, and `loom data inspect` reads a URL.
Byte-level tokenizer, a few KB of text, in-process except one CLI call."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from s3_helpers import LocalS3

import loom.data.prepare.run as run_mod
from loom.cli import main
from loom.data.prepare import prepare, units_for_inputs
from loom.data.prepare.show import inspect_text
from loom.data.prepare.upload import RemoteOut
from loom.data.store import SIDECAR, StorageSettings, StoreError, open_store
from loom.data.store.remote.transport import StorageUnavailable
from loom.errors import ConfigError

UNITS = 6
_REAL_UNIT_DONE = RemoteOut.unit_done


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def env(s3, tmp_path, monkeypatch) -> Iterator[None]:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    yield
    s3.faults.down, s3.faults.fail_next, s3.faults.drop_next = False, 0, 0


def _settings(s3: LocalS3) -> StorageSettings:
    return StorageSettings(endpoint_url=s3.endpoint, retry_s=0.5)


def _inputs(tmp_path: Path, chars: int = 300) -> tuple[str, list]:
    """UNITS text files of equal size, one unit each."""
    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    for i in range(UNITS):
        (d / f"f{i}.txt").write_text(f"file {i}: " + "lorem ipsum ✓ " * chars)
    glob = str(d / "*.txt")
    return glob, units_for_inputs([glob], "text", (d / "f0.txt").stat().st_size)


def _keys(s3: LocalS3, bucket: str) -> list[str]:
    return [o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def _same_tokens(url: str, local: Path, settings: StorageSettings) -> None:
    r, loc = open_store(url, storage=settings), open_store(local)
    assert r.n_tokens == loc.n_tokens > 0 and r.n_docs == loc.n_docs
    assert (r.read(0, r.n_tokens) == loc.read(0, loc.n_tokens)).all()
    assert (r.doc_starts(0, r.n_tokens) == loc.doc_starts(0, loc.n_tokens)).all()
    assert r.sidecar == loc.sidecar


def _stop_after(monkeypatch, uploads: int, stop) -> None:
    """RemoteOut.unit_done calls `stop()` once `uploads` units have been uploaded."""
    done = []
    real = RemoteOut.unit_done

    def unit_done(self, stats) -> None:
        real(self, stats)
        done.append(stats["unit"])
        if len(done) == uploads:
            stop()

    monkeypatch.setattr(RemoteOut, "unit_done", unit_done)


def _count_units(monkeypatch) -> list[int]:
    ran: list[int] = []
    real = run_mod.run_unit

    def counted(i, *a, **kw):
        ran.append(i)
        return real(i, *a, **kw)

    monkeypatch.setattr(run_mod, "run_unit", counted)
    return ran


def _interrupt() -> None:
    raise KeyboardInterrupt


def test_a_remote_store_reads_what_the_local_one_does_sidecar_last(s3, tmp_path, monkeypatch):
    _, units = _inputs(tmp_path)
    settings, url = _settings(s3), s3.bucket("same") + "/tok/web"
    calls: list[str] = []
    real = RemoteOut._call
    monkeypatch.setattr(RemoteOut, "_call", lambda self, what, call: (calls.append(what), real(self, what, call))[1])
    stage = tmp_path / "stage"
    sc = prepare(units, RemoteOut(url, settings, stage), None, workers=1, progress="none")
    prepare(units, tmp_path / "local", None, workers=1, progress="none")
    _same_tokens(url, tmp_path / "local", settings)
    assert set(sc["index_sha256"]) == {f"part-{i:05d}" for i in range(UNITS)}
    uploads = [c for c in calls if c.startswith("uploading")]
    assert uploads[0].endswith("/.prepare/plan.json") and uploads[-1] == f"uploading {url}/{SIDECAR}"
    assert [c.rsplit("/", 1)[1] for c in uploads[1:4]] == ["part-00000.bin", "part-00000.idx", "part-00000.json"]
    assert calls[-1].startswith("deleting") and not stage.exists()
    assert not any("/.prepare/" in k for k in _keys(s3, "same"))


def test_an_interrupted_or_cut_off_prepare_resumes_only_the_units_not_uploaded(s3, tmp_path, monkeypatch):
    _, units = _inputs(tmp_path)
    settings, url = _settings(s3), s3.bucket("resume") + "/store"
    stage = tmp_path / "stage"
    _stop_after(monkeypatch, 2, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(units, RemoteOut(url, settings, stage), None, workers=1, progress="none")
    keys = _keys(s3, "resume")
    assert "store/.prepare/plan.json" in keys and f"store/{SIDECAR}" not in keys
    assert sorted(p.name for p in stage.glob("part-*")) == []  # uploaded shards are deleted here
    with pytest.raises(StoreError, match="interrupted"):
        open_store(url, storage=settings)
    with pytest.raises(ConfigError, match="interrupted"):
        inspect_text(url, settings)

    ran = _count_units(monkeypatch)  # same stage, then an outage after one more upload
    _stop_after(monkeypatch, 1, lambda: setattr(s3.faults, "down", True))
    with pytest.raises(StorageUnavailable, match="part-00003"):
        prepare(units, RemoteOut(url, settings, stage), None, workers=1, progress="none")
    assert ran == [2, 3] and f"store/{SIDECAR}" not in _keys(s3, "resume")
    assert (stage / "part-00003.bin").is_file()  # tokenized, not uploaded: kept here
    s3.faults.down = False

    ran.clear()  # same stage: unit 3 is uploaded from it, not tokenized again
    _stop_after(monkeypatch, 1, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(units, RemoteOut(url, settings, stage), None, workers=1, progress="none")
    assert ran == [] and "store/.prepare/done/part-00003.json" in _keys(s3, "resume")

    ran.clear()  # another machine (a fresh stage); a shard whose .bin went missing is redone
    monkeypatch.setattr(RemoteOut, "unit_done", _REAL_UNIT_DONE)
    s3.client().delete_object(Bucket="resume", Key="store/part-00001.bin")
    prepare(units, RemoteOut(url, settings, tmp_path / "stage2"), None, workers=1, progress="none")
    assert ran == [1, 4, 5]
    prepare(units, tmp_path / "local", None, workers=1, progress="none")
    _same_tokens(url, tmp_path / "local", settings)


def test_another_plan_a_complete_store_or_a_foreign_prefix_is_refused(s3, tmp_path, monkeypatch, capsys):
    glob, units = _inputs(tmp_path)
    settings, url = _settings(s3), s3.bucket("refuse") + "/store"
    _stop_after(monkeypatch, 1, _interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(units, RemoteOut(url, settings), None, workers=1, progress="none")
    with pytest.raises(ConfigError, match="--strict") as e:
        prepare(units, RemoteOut(url, settings), None, workers=1, progress="none", strict=True)
    assert url in str(e.value)
    monkeypatch.setattr(RemoteOut, "unit_done", _REAL_UNIT_DONE)
    args = ["data", "prepare", glob, "--out", url, "--shard-mb", str(units[0].bytes / (1 << 20)), "--workers", "1"]
    assert main(args) == 0 and f"wrote {url}" in capsys.readouterr().out
    assert main(args) == 2 and f"--out {url} is already a complete token store" in capsys.readouterr().err
    s3.client().put_object(Bucket="refuse", Key="other/notes.txt", Body=b"hello")
    assert main([*args[:4], "s3://refuse/other", *args[5:]]) == 2
    assert "--out s3://refuse/other holds 1 object(s)" in capsys.readouterr().err
    assert main([*args[:4], "s3://no-such-bucket/x", *args[5:]]) == 2
    assert "s3://no-such-bucket/x: its bucket does not exist" in capsys.readouterr().err
    assert main([*args, "--stage", str(tmp_path / "st"), "--out", str(tmp_path / "loc")]) == 2
    assert "--stage" in capsys.readouterr().err
    monkeypatch.setattr("loom.data.prepare.command.StorageSettings", functools.partial(StorageSettings, retry_s=0.3))
    s3.faults.down = True
    assert main([*args[:4], url + "-2", *args[5:]]) == 1
    err = capsys.readouterr().err
    assert "did not answer" in err and f"Nothing is visible as a store at {url}-2" in err


def test_a_shard_over_two_parts_goes_up_multipart(s3, tmp_path, monkeypatch):
    monkeypatch.setattr("moto.s3.models.S3_UPLOAD_PART_MIN_SIZE", 256)  # S3's is 5 MiB
    _, units = _inputs(tmp_path, chars=3000)  # ~42 KB shards
    settings, url = _settings(s3), s3.bucket("multi") + "/store"
    prepare(units[:2], RemoteOut(url, settings, part_bytes=16 << 10), None, workers=1, progress="none")
    etag = s3.client().head_object(Bucket="multi", Key="store/part-00000.bin")["ETag"]
    assert etag.strip('"').endswith("-3")  # a multipart object's ETag counts its parts
    prepare(units[:2], tmp_path / "local", None, workers=1, progress="none")
    _same_tokens(url, tmp_path / "local", settings)


def test_inspect_reads_a_url(s3, tmp_path):
    _, units = _inputs(tmp_path)
    settings, url = _settings(s3), s3.bucket("inspect") + "/store"
    prepare(units, RemoteOut(url, settings), None, workers=1, progress="none")
    prepare(units, tmp_path / "local", None, workers=1, progress="none")
    text, local = inspect_text(url, settings), inspect_text(tmp_path / "local")
    assert url in text.splitlines()[0] and text.splitlines()[1:] == local.splitlines()[1:]
    assert f"shards ({UNITS}): part-00000, part-00001" in text
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-m", "loom.cli", "data", "inspect", url, "--endpoint-url", s3.endpoint],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == text.strip(), p.stderr
    np.testing.assert_equal(open_store(url, storage=settings).n_tokens, open_store(tmp_path / "local").n_tokens)
