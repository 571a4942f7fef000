"""Models and fixtures-on-disk for tests/test_data.py and tests/test_models.py.

Importable by the `loom` subprocesses through PYTHONPATH=tests/ (see `helpers_env`), and
allowed as `_target_`s with security.allow_targets='[tests_helpers.]'.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent


class IdSamples(torch.utils.data.Dataset):
    """A map-style set whose sample i is a Batch of i (its loaders' batches show which ids they read)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        from loom.data.batch import Batch

        return Batch(torch.tensor(i), torch.tensor(i))


def helpers_env(tmp: Path) -> dict[str, str]:
    """Env for a `loom` subprocess: this directory importable, HF caches under tmp."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HF_HOME": str(tmp / "hf_home")}


class DigitsLit(pl.LightningModule):
    """A user's own LightningModule: no `.model` attribute, no configure_optimizers (Loom's
    optimizer is used). `delay` slows each step so a test can kill a run part-way."""

    def __init__(self, hidden: int = 32, delay: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))
        self.delay = delay

    def training_step(self, batch, batch_idx):
        if self.delay:
            time.sleep(self.delay)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y), sync_dist=True)


class StragglerLit(DigitsLit):
    """DigitsLit where one rank is slow in its own compute (sleeps in training_step) and another
    in its data loading (sleeps before its batch is handed over): two stragglers, two causes."""

    def __init__(self, compute_rank: int = -1, data_rank: int = -1, delay: float = 0.2) -> None:
        super().__init__()
        self.compute_rank, self.data_rank, self.slow = compute_rank, data_rank, delay

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training and self.global_rank == self.data_rank:
            time.sleep(self.slow)  # before on_train_batch_start: counted as data wait
        return batch

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.compute_rank:
            time.sleep(self.slow)
        return super().training_step(batch, batch_idx)


class BatchCounter(pl.Callback):
    """A user's own callback (trainer.callbacks): writes <run>/user-callback-rank-N.json at the
    end of training: the train batches it saw, its argument, and the Trainer's callbacks in
    the order Lightning calls them."""

    def __init__(self, tag: str = "") -> None:
        self.tag, self.batches = tag, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(trainer.default_root_dir) / f"user-callback-rank-{trainer.global_rank}.json"
        out.write_text(json.dumps({"batches": self.batches, "tag": self.tag,
                                   "order": [type(c).__name__ for c in trainer.callbacks]}))


class HangLit(DigitsLit):
    """DigitsLit whose rank `rank` blocks forever in training_step at step `step` (a hang)."""

    def __init__(self, rank: int = 1, step: int = 5) -> None:
        super().__init__()
        self.hang_rank, self.hang_step = rank, step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.hang_rank and self.trainer.global_step + 1 == self.hang_step:
            threading.Event().wait()  # forever: only the hang watchdog ends this process
        return super().training_step(batch, batch_idx)


class TinyTokenNet(nn.Module):
    """A user's plain nn.Module over tokens: (B, T) ids -> (B, T, V) logits."""

    def __init__(self, vocab_size: int = 256, width: int = 32, api_token: str | None = None) -> None:
        super().__init__()
        if api_token is not None and api_token != os.environ.get("LOOM_TEST_API_TOKEN"):
            raise ValueError("api_token did not arrive from the environment")  # the worker must resolve it
        self.emb = nn.Embedding(vocab_size, width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.emb(x)))


class FailsOnce(TinyTokenNet):
    """TinyTokenNet whose forward fails once while `fail-next-trial` exists in the working dir
    (removing it): one trial of a sweep fails at run time (the plan's meta build runs no forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flag = Path("fail-next-trial")
        if flag.exists():
            flag.unlink()
            raise RuntimeError("injected failure of this trial")
        return super().forward(x)


class NotAModule:
    """Neither a LightningModule nor an nn.Module."""


CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n" * 2,
    "lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 2,
    "pack my box with five dozen liquor jugs! " * 3,
]


def write_json_corpus(path: Path, n_docs: int = 200, column: str = "content") -> Path:
    """JSON lines with a `column` text column and an `id` column."""
    with open(path, "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"id": i, column: f"{i}: " + CORPUS[i % len(CORPUS)]}) + "\n")
    return path


def make_tokenizer(dest: Path, vocab_size: int = 300) -> Path:
    """A small BPE tokenizer trained on CORPUS, saved with save_pretrained (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(dest))
    return dest


def make_hf_config(dest: Path, vocab_size: int, n_positions: int = 64) -> Path:
    """A tiny GPT-2 config.json (no weights: the model is randomly initialized)."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
               bos_token_id=1, eos_token_id=1).save_pretrained(str(dest))
    return dest


def cache_hub_dataset(hf_home: Path, repo: str, corpus: Path) -> str:
    """`repo` (owner/name) as the `datasets` library's own cache under `hf_home` holds a hub
    dataset it has downloaded once: built from the local JSON lines `corpus` by the library, then
    placed where an offline `load_dataset(repo)` looks (<HF_HOME>/datasets/<owner>___<name>/
    default/0.0.0/<hash>/ with <name>-train.arrow). No network. Returns `repo`."""
    import shutil

    import datasets

    built_ds = datasets.load_dataset("json", data_files=[str(corpus)], split="train", cache_dir=str(hf_home / "build"))
    built = Path(built_ds.cache_files[0]["filename"]).parent
    owner, name = repo.split("/")
    dest = hf_home / "datasets" / f"{owner}___{name}" / "default" / "0.0.0" / built.name
    dest.mkdir(parents=True)
    info = json.loads((built / "dataset_info.json").read_text())
    (dest / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default", "dataset_name": name}))
    shutil.copy(built / "json-train.arrow", dest / f"{name}-train.arrow")
    shutil.rmtree(hf_home / "build")
    return repo


class Encoder:
    """One document at a time, as the tokenizer's own `__call__` encodes it (the reference
    tests/test_data_prepare.py holds `loom data prepare`'s batch encoder to): byte level, each document's bytes and a
    newline; with a tokenizer, its ids and its EOS id."""

    def __init__(self, tokenizer: str | None) -> None:
        self.tok = None
        if tokenizer:
            from loom.data.tokenizer import load_tokenizer

            self.tok = load_tokenizer(tokenizer)

    def encode_batch(self, docs: list[str | bytes]) -> list[numpy.ndarray]:
        if self.tok is None:
            return [numpy.frombuffer((d if isinstance(d, bytes) else d.encode()) + b"\n", dtype=numpy.uint8)
                    for d in docs]
        texts = [d.decode() if isinstance(d, bytes) else d for d in docs]
        eos = [] if self.tok.eos_token_id is None else [self.tok.eos_token_id]
        return [numpy.asarray(ids + eos) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]


def assert_refused_without_torch(verb: str, cases: dict[str, tuple[list[str], list[str]]], cwd: Path) -> None:
    """Each case `name: (argv, needles)` of `loom <verb> argv` exits 2 with one line holding every
    needle and no traceback, all in one fresh interpreter that never imports torch."""
    import subprocess
    import sys

    script = (
        "import json, sys, io, contextlib\nfrom loom import cli\nout = {}\n"
        f"for name, argv in {json.dumps({k: v[0] for k, v in cases.items()})}.items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        f"        out[name] = [cli.main([{verb!r}, *argv]), err.getvalue()]\n"
        "out['torch imported'] = 'torch' in sys.modules\nprint(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got.pop("torch imported") is False
    for name, (_, needles) in cases.items():
        rc, err = got[name]
        assert rc == 2, (name, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)
        for needle in needles:
            assert needle in err, (name, needle, err)
