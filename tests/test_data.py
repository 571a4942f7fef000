"""Datasets as config groups: sampling, caches, validation, and real 2-rank runs.

Real runs use the digits dataset with a user LightningModule from tests_helpers (each step
slowed a little so a worker can be killed mid-epoch), the text_files corpus with GPT models,
and record the sample ids every rank trained on (LOOM_RECORD_SAMPLE_IDS).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    LoomResult,
    kill_one_worker_after,
    launching_fixture,
    refused,
    run_loom,
    start_loom,
)
from tests_helpers import CORPUS, IdSamples, helpers_env, write_json_corpus

from loom.data.sampler import ResumableDistributedSampler
from loom.errors import ConfigError
from loom.pipeline import resolve

# ----------------------------------------------------------------------------- in-process


def _datamodules(cfg, dp_size=2):
    from loom.data import build_datamodule
    from loom.strategies import layout_of

    layout = layout_of(cfg, world=dp_size)
    dms = [build_datamodule(cfg, layout, r) for r in range(dp_size)]
    dms[0].prepare_data()
    for dm in dms:
        dm.setup("fit")
        dm.train_dataloader()
    return dms


def _epoch(dms, epoch):
    out = []
    for dm in dms:
        dm.train_sampler.set_epoch(epoch)
        out.append(list(dm.train_sampler))
    return out


def test_sampler_shards_are_disjoint_cover_the_epoch_and_resume_mid_epoch():
    n = 103
    samplers = [ResumableDistributedSampler(range(n), num_replicas=2, rank=r, micro_batch=4, global_batch=8,
                                            shuffle=True, seed=7) for r in range(2)]
    for epoch in (0, 1):
        parts = []
        for s in samplers:
            s.set_epoch(epoch)
            parts.append(list(s))
        assert not set(parts[0]) & set(parts[1])
        assert len(set(parts[0]) | set(parts[1])) == n - n % 8  # whole global batches only
        assert len(parts[0]) == len(samplers[0])
        if epoch == 0:
            first = parts
    assert first != parts  # reshuffled per epoch
    s = samplers[1]
    s.set_epoch(1)
    full = list(s)
    s.resume_at(1, 16)  # 16 samples of the global order consumed: 2 micro batches of each rank
    assert list(s) == full[8:]  # resumed: skips what the epoch already consumed
    assert list(s) == full       # once: the next pass is whole again


def test_a_restored_position_reaches_the_sampler_before_a_loader_with_workers_pulls_indices():
    """Lightning iterates the train loader in setup_data, before on_train_start, and a loader with
    workers takes its first indices from the sampler right then: the checkpoint's position must be
    with the sampler by then (given at restore, DataPosition.load_state_dict), or the resumed epoch
    starts over (every GPU profile has loader workers)."""
    from types import SimpleNamespace

    from loom.data.module import LoomDataModule
    from loom.data.position import DataPosition

    cfg = resolve(["dataset=synthetic", "dataset.batch_size=4", "trainer.global_batch_size=8", "hardware=cpu",
                   "hardware.devices=2", "hardware.dataloader_workers=1", "strategy=ddp"])
    order = ResumableDistributedSampler(range(64), 2, 0, micro_batch=4, global_batch=8, seed=cfg.seed).global_order()
    dm = LoomDataModule(cfg, 0, 2)
    dm.train_set = IdSamples(64)
    position = DataPosition()
    position._trainer = SimpleNamespace(datamodule=dm)  # as Callback.setup leaves it, before the restore
    position.load_state_dict({"epoch": 0, "batches": 3, "samples": 16, "dp": 1})  # saved at 1 rank, step 2
    assert dm.resume_position == (0, 16)
    first = next(iter(dm.train_dataloader()))  # the loader's worker has pulled its indices by now
    assert first.inputs.tolist() == order[16:20]  # rank 0's micro batch 4 of the global order: not order[0:4]


def test_validation_evaluates_the_same_windows_at_any_world_size():
    """trainer.limit_val_batches counts global batches of held-out windows: at 1, 2 and 4 data-parallel
    ranks (the global batch kept) the ranks together evaluate exactly the set's first 3 x 16 windows
    (it counted batches per rank: 2 ranks evaluated twice 1 rank's, and another validation loss); a set
    holding fewer evaluates its whole global batches, the same at any world size too."""
    from loom.data.module import LoomDataModule

    def seen(cfg, dp: int, windows: int) -> list[int]:
        out, counts = [], set()
        for rank in range(dp):
            dm = LoomDataModule(cfg, rank, dp)
            dm.val_set = IdSamples(windows)  # a map-style set of its own indices
            batches = list(dm.val_dataloader())
            counts.add(len(batches))
            out += [int(i) for b in batches for i in b.inputs]
        assert len(counts) == 1  # every rank the same number of whole batches: the mean over ranks is the mean
        return sorted(out)

    for dp in (1, 2, 4):
        cfg = resolve(["dataset=synthetic", "dataset.batch_size=4", "trainer.global_batch_size=16",
                       "trainer.limit_val_batches=3", "hardware=cpu", f"hardware.devices={dp}", "hardware.dataloader_workers=0",
                       "strategy=ddp" if dp > 1 else "strategy=single"])
        assert seen(cfg, dp, 1000) == list(range(48)), dp
        assert seen(cfg, dp, 40) == list(range(32)), dp  # two whole global batches of the 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i in range(30):
        (d / f"doc{i:02d}.txt").write_text(CORPUS[i % len(CORPUS)] * 8)
    (d / "sub").mkdir()
    (d / "sub" / "deep.txt").write_text("nested " * 100)
    return d


@pytest.mark.parametrize("case", ["tinycode", "text_files", "hf_saved", "hf_json", "digits",
                                  "synthetic_tokens", "synthetic_tensors"])
def test_every_dataset_shards_disjointly_over_ranks(case, corpus, tmp_path):
    cache = f"dataset.cache_dir={tmp_path / 'cache'}"
    overrides = {
        "tinycode": ["dataset.max_bytes=300000", cache],
        "text_files": ["dataset=text_files", f"dataset.paths=[{corpus}/*.txt,{corpus}/**/*.txt]", cache,
                       "dataset.seq_len=64", "dataset.batch_size=4"],
        "hf_json": ["dataset=hf", f"dataset.path={write_json_corpus(tmp_path / 'd.jsonl')}",
                    "dataset.text_column=content", "dataset.seq_len=32", "dataset.batch_size=4", cache],
        "digits": ["dataset=digits", "model=mlp"],
        "synthetic_tokens": ["dataset=synthetic", "dataset.num_samples=100", "dataset.seq_len=16"],
        "synthetic_tensors": ["dataset=synthetic", "dataset.kind=tensors", "dataset.shape=[2,3]",
                              "dataset.num_samples=100", "model=mlp"],
    }
    if case == "hf_saved":
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": CORPUS * 40}),
                              "test": datasets.Dataset.from_dict({"text": CORPUS})}).save_to_disk(tmp_path / "saved")
        overrides[case] = ["dataset=hf", f"dataset.path={tmp_path / 'saved'}", "dataset.seq_len=32",
                           "dataset.batch_size=4", cache]
    cfg = resolve(overrides[case])
    dms = _datamodules(cfg)
    n = len(dms[0].train_set)
    parts = _epoch(dms, 0)
    assert not set(parts[0]) & set(parts[1])
    union = set(parts[0]) | set(parts[1])
    gbs = dms[0].global_batch  # the epoch: whole global batches of the global order
    assert union <= set(range(n)) and len(union) == n - n % gbs
    x, y = dms[0].train_set[parts[0][0]]
    if case.startswith("digits") or case.endswith("tensors"):
        assert x.dtype.is_floating_point and y.dim() == 0
        assert tuple(x.shape) == ((64,) if case == "digits" else (2, 3))
    else:
        assert x.shape == y.shape == (cfg.dataset.seq_len,) and (x[1:] == y[:-1]).all()
    if case == "synthetic_tokens":  # deterministic from the seed, no I/O
        again = _datamodules(cfg)[1].train_set[5].inputs
        assert (again == dms[1].train_set[5].inputs).all()
        other = _datamodules(resolve([*overrides[case], "seed=1"]))[1].train_set[5].inputs
        assert not (other == again).all()


def test_text_files_with_few_files_hold_out_windows_for_validation(tmp_path):
    """Two big files and val_every=20: a file split would validate on nothing, so every
    round(1/val_fraction)-th window of the corpus is validation: deterministic, disjoint, and
    counted before launch (the size check) as the ranks build it."""
    from loom.data import val_size
    from loom.data.options.text_files.corpus import datasets as token_sets

    for i in range(2):
        (tmp_path / f"book{i}.txt").write_text(CORPUS[i % len(CORPUS)] * 200)
    args = ["dataset=text_files", f"dataset.paths=[{tmp_path}/*.txt]", f"dataset.cache_dir={tmp_path / 'c'}",
            "dataset.seq_len=32", "dataset.batch_size=2"]
    for fraction, k in ((None, 20), (0.25, 4)):
        cfg = resolve([*args, *([f"dataset.val_fraction={fraction}"] if fraction else [])])
        train, val = token_sets(cfg)
        n = len(train) + len(val)
        assert len(val) == n // k and len(val) == val_size(cfg) > 0
        source = train.sources[0]
        assert val.window(0) == k - 1 and source.holdout.k == k
        store = source.store
        assert val[0].inputs.tolist() == store.read((k - 1) * 32, 32).tolist()  # window k-1 of the corpus
        assert all(source.window(t) % k != k - 1 for t in range(len(source)))
        again_train, again_val = token_sets(cfg)
        assert [again_val.window(i) for i in range(len(val))] == [val.window(i) for i in range(len(val))]
    refused(tmp_path, *args, "dataset.val_fraction=1.5")


def test_token_cache_is_reused_and_tokenizer_sized(tmp_path, corpus):
    from tests_helpers import make_tokenizer

    from loom.data.options.text_files.corpus import datasets as _token_sets

    tok = make_tokenizer(tmp_path / "tok")
    cfg = resolve(["dataset=text_files", f"dataset.paths=[{corpus}/*.txt]", f"dataset.cache_dir={tmp_path / 'c'}",
                   f"dataset.tokenizer={tok}", "dataset.seq_len=16", "dataset.batch_size=2",
                   "model.vocab_size=300"])
    train, _ = _token_sets(cfg)
    store = train.sources[0].store
    assert store.dtype.name == "uint16" and store.sidecar["vocab_size"] == 300
    assert int(store.read(0, store.n_tokens).max()) < 300
    files = sorted(store.path.rglob("*"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    import loom.data.prepare as prepare

    calls = []
    orig = prepare.prepare
    prepare.prepare = lambda *a, **k: calls.append(a) or orig(*a, **k)
    try:
        again, _ = _token_sets(cfg)
    finally:
        prepare.prepare = orig
    assert calls == [] and again.sources[0].store.path == store.path
    assert [f.stat().st_mtime_ns for f in sorted(store.path.rglob("*"))] == mtimes


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["dataset=text_files", "dataset.paths=[/nonexistent/*.txt]"], ["dataset.paths", "/nonexistent/*.txt", "matches no files"]),
        (["dataset=text_files", "dataset.paths=[EMPTY]"], ["dataset.paths", "empty"]),
        (["dataset=text_files"], ["dataset.paths", "at least one"]),
        (["dataset=hf", "dataset.path=JSON", "dataset.text_column=body"], ["dataset.text_column", "'body'", "content", "id"]),
        (["dataset=hf", "dataset.hub=loom-tests/never-cached"], ["dataset.hub", "not cached", "dataset.online=true"]),
        (["dataset=hf"], ["dataset.hub", "exactly one"]),
        (["dataset.tokenizer=/nonexistent/tokenizer"], ["dataset.tokenizer", "not available locally"]),
        (["dataset=synthetic", "dataset.kind=images"], ["dataset.kind", "tokens, tensors"]),
        (["dataset=digits"], ["model.name", "gpt_tiny", "digits"]),
        (["model=mlp"], ["model.name", "mlp", "tinycode"]),
        (["dataset=synthetic", "dataset.vocab_size=1000"], ["model.vocab_size", "256", "1000"]),
    ],
)
def test_bad_dataset_input_names_the_key_and_the_fix(overrides, needles, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    (tmp_path / "empty.txt").write_text("")
    json_path = write_json_corpus(tmp_path / "d.jsonl", 5)
    overrides = [o.replace("EMPTY", str(tmp_path / "empty.txt")).replace("JSON", str(json_path)) for o in overrides]
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert len(msg.splitlines()) <= 2


def test_cli_refuses_a_path_matching_nothing_before_any_process_starts(tmp_path):
    err = refused(tmp_path, "dataset=text_files", "dataset.paths=[nope/**/*.md]")
    assert "dataset.paths" in err and "matches no files" in err
    assert not (tmp_path / "gpt").exists()


# ----------------------------------------------------------------------------- real runs

BASE = [a for a in FAST if not a.startswith("dataset.")]  # FAST minus tinycode's size cap
DIGITS = [*BASE, "dataset=digits", "model=custom", "model.module._target_=tests_helpers.DigitsLit",
          "+model.module.delay=0.03", "security.allow_targets=[tests_helpers.]", "trainer.max_steps=30",
          "checkpoint.every_n_steps=10", "run.id=digits"]
PER_EPOCH = (1438 // 2) // 32  # digits train split per rank / micro batch: 22 batches


def _ids(record: Path) -> dict[int, dict[int, tuple[int, list[int]]]]:
    """rank -> step -> (epoch, ids); a later line for a step (a resumed attempt) wins."""
    out: dict[int, dict[int, tuple[int, list[int]]]] = {}
    for f in sorted(record.glob("rank-*.txt")):
        rank = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            out.setdefault(rank, {})[step] = (epoch, ids)
    return out


@launching_fixture(scope="module")
def digits_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits_ref")
    r = run_loom("train", *DIGITS, root=root, env={**helpers_env(root), "LOOM_RECORD_SAMPLE_IDS": str(root / "ids")})
    assert r.rc == 0, r.out + r.err
    return r, _ids(root / "ids")


def test_digits_two_ranks_see_disjoint_samples_covering_the_epoch(digits_reference):
    r, ids = digits_reference
    s = r.summary()
    assert s["status"] == "completed" and s["global_step"] == 30
    assert s["samples"] == s["tokens"] == 30 * 2 * 32  # classification: one item per sample
    assert s["final_weights"] and (r.run_dir / "final" / "model.safetensors").is_file()
    assert sorted(ids) == [0, 1] and sorted(ids[0]) == sorted(ids[1]) == list(range(1, 31))
    epoch0 = [[i for step in sorted(ids[rank]) if ids[rank][step][0] == 0 for i in ids[rank][step][1]]
              for rank in (0, 1)]
    assert len(epoch0[0]) == len(epoch0[1]) == PER_EPOCH * 32
    assert not set(epoch0[0]) & set(epoch0[1])
    assert len(set(epoch0[0])) == len(epoch0[0])
    seen = set(epoch0[0]) | set(epoch0[1])
    # the union is the epoch: every train sample, less each rank's last partial batch (drop_last)
    assert seen <= set(range(1438)) and len(seen) == 1438 - 2 * ((1438 // 2) % 32)
    assert {ids[0][s][0] for s in ids[0]} == {0, 1}  # crossed into the second epoch
    assert r.losses()[30] < r.losses()[1]


@pytest.mark.launch
def test_killed_mid_epoch_resumes_with_exactly_the_remaining_samples(tmp_path, digits_reference):
    ref, ref_ids = digits_reference
    env = {**helpers_env(tmp_path), "LOOM_RECORD_SAMPLE_IDS": str(tmp_path / "ids")}
    run_dir = tmp_path / "custom" / "digits"  # experiment: the model family (custom)
    # steps 3-4 profiled (trainer.profile, volatile like max_restarts): the profiler only observes,
    # so the curve and weights below still equal the unprofiled reference's, bit for bit
    proc = start_loom("train", *DIGITS, "hardware.max_restarts=1", "trainer.profile.steps=[3,5]", root=tmp_path, env=env)
    killed = kill_one_worker_after(proc, run_dir, 10, ranks=2, timeout=300)
    out = killed.out
    assert killed.rc == 0, out
    s = killed.summary()
    assert s["restarts"] == 1 and s["resumed_from_step"] in (10, 20) and s["global_step"] == 30
    ids = _ids(tmp_path / "ids")
    # mid-epoch (10 of 22 batches): the resumed attempt trained exactly the samples the
    # uninterrupted run did at every step, in the same order
    assert ids == ref_ids
    assert LoomResult(0, out, "", run_dir).losses() == ref.losses()
    # and bit-identical final weights: the one SIGKILL -> torchrun restart -> exact resume test
    want, got = _weights(ref.run_dir), _weights(run_dir)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert sorted(p.name for p in (run_dir / "profile").glob("rank-*.pt.trace.json.gz")) == [
        "rank-0.pt.trace.json.gz", "rank-1.pt.trace.json.gz"]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.mark.launch
def test_text_files_trains_from_its_packed_cache(tmp_path, corpus):
    """A text_files run packed by document trains under fsdp_tp from its train/val stores in
    the cache. That a second
    run reuses the cache without re-tokenizing is test_token_cache_is_reused_and_tokenizer_sized
    (in-process, the same datasets() call a run makes)."""
    cache = tmp_path / "cache"
    args = [*BASE, "dataset=text_files", f"dataset.paths=[{corpus}/*.txt]", f"dataset.cache_dir={cache}",
            "dataset.seq_len=64", "dataset.batch_size=4", "trainer.max_steps=4", "dataset.packing=documents",
            "strategy=fsdp_tp", "hardware.devices=4", "strategy.tensor_parallel=2"]
    r = run_loom("train", *args, root=tmp_path)
    assert r.rc == 0, r.out + r.err
    assert "documents packed apart" in r.out  # document masks under tensor parallelism (2 x 2)
    assert r.summary()["tokens"] == 4 * 2 * 4 * 64 and r.summary()["parallel"]["tp"] == 2
    rate = r.summary()["throughput"]  # masked batches (no target across a document boundary): trained counted
    assert 0 < rate["trained_tokens_per_sec"] <= rate["overall"]["tokens_per_sec"], rate
    stores = sorted(cache.glob("text_files-*/*/loom.json"))
    assert [f.parent.name for f in stores] == ["train", "val"]
