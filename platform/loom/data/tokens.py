"""Token files on disk (one per split, memory-mapped) and the packed fixed-length dataset.

A corpus is a sequence of documents; tokenizing writes their tokens back to back (byte
level: each document's bytes and a newline; a tokenizer: its ids and, when it has one, its
EOS id) into `<cache>/<name>-<key>.<split>.<u8|u16|u32>`. The file is written to a temporary
name and renamed, so a concurrent reader never sees half a file, and a later run with the
same corpus and tokenizer reuses it without tokenizing again (the key fingerprints both).
Packing is by windowing at read time: the file does not depend on `dataset.seq_len`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from loom.atomic import atomic_path
from loom.data.files import split

DTYPES = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32}


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "loom" / "datasets"


def fingerprint(files: list[Path], *extra: object) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{int(st.st_mtime)}\n".encode())
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def suffix_for(vocab_size: int | None) -> str:
    """u8 for bytes, u16 while the vocabulary fits in 16 bits, else u32."""
    if vocab_size is None:
        return "u8"
    return "u16" if vocab_size <= 2**16 else "u32"


class Encoder:
    """Byte-level (no vocabulary file, vocab 256) or a Hugging Face tokenizer available locally."""

    def __init__(self, tokenizer: str | None) -> None:
        self.name = tokenizer
        self.tok = None
        self.calls = 0  # documents tokenized by this process (tests count re-tokenization)
        if tokenizer:
            from loom.data.tokenizer import load_tokenizer

            self.tok = load_tokenizer(tokenizer)

    @property
    def vocab_size(self) -> int:
        return 256 if self.tok is None else len(self.tok)

    @property
    def suffix(self) -> str:
        return suffix_for(None if self.tok is None else self.vocab_size)

    def key(self) -> str:
        """What the token file depends on: the tokenizer's identity and vocabulary."""
        if self.tok is None:
            return "bytes"
        vocab = sorted(self.tok.get_vocab().items())
        return hashlib.sha1(repr((self.name, vocab)).encode()).hexdigest()[:12]

    def encode_batch(self, docs: list[str | bytes]) -> list[np.ndarray]:
        self.calls += len(docs)
        if self.tok is None:
            return [np.frombuffer((d if isinstance(d, bytes) else d.encode()) + b"\n", dtype=np.uint8)
                    for d in docs]
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        eos = self.tok.eos_token_id
        dtype = DTYPES[self.suffix]
        return [np.asarray(list(x) + ([eos] if eos is not None else []), dtype=dtype) for x in ids]


def write_token_file(docs: Callable[[], Iterable[str | bytes]], dest: Path, encoder: Encoder,
                     batch: int = 256) -> Path:
    """Tokenize `docs()` into `dest` once (an existing `dest` is reused as is, `docs` not called)."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    buf: list[str | bytes] = []
    with atomic_path(dest) as tmp, open(tmp, "wb") as out:
        for doc in docs():
            buf.append(doc)
            if len(buf) >= batch:
                for arr in encoder.encode_batch(buf):
                    out.write(arr.tobytes())
                buf = []
        for arr in encoder.encode_batch(buf) if buf else []:
            out.write(arr.tobytes())
    return dest


def build_token_file(files: list[Path], dest: Path, encoder: Encoder | None = None) -> Path:
    """Concatenate files (one document each) into a token file at `dest`, once."""
    return write_token_file(lambda: (f.read_bytes() for f in files), dest, encoder or Encoder(None), batch=64)


class PackedTokens(Dataset):
    """Non-overlapping windows of seq_len+1 tokens over one memory-mapped token file."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.tokens = np.memmap(self.path, dtype=DTYPES[self.path.suffix.lstrip(".")], mode="r")
        self.n = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def token_datasets(
    name: str, key: str, cache_dir: str | None, seq_len: int, encoder: Encoder,
    train_docs: Callable[[], Iterable[str | bytes]], val_docs: Callable[[], Iterable[str | bytes]],
) -> tuple[PackedTokens, PackedTokens | None]:
    """The packed train and val sets (val None when empty), tokenizing only when the cache
    lacks them: `*_docs` are called only then."""
    root = cache_root(cache_dir)
    tkey = "" if encoder.tok is None else f"-{encoder.key()}"
    out: list[PackedTokens | None] = []
    for part, docs in (("train", train_docs), ("val", val_docs)):
        path = write_token_file(docs, root / f"{name}-{key}{tkey}.{part}.{encoder.suffix}", encoder)
        ds = PackedTokens(path, seq_len) if path.stat().st_size > seq_len else None
        out.append(ds if ds is not None and len(ds) > 0 else None)
    if out[0] is None:
        raise ValueError(f"dataset {name}: the training split has fewer than seq_len+1={seq_len + 1} tokens")
    return out[0], out[1]


class WindowSubset(Dataset):
    """Some of a PackedTokens' windows (by index). `tokens` is the whole token file's on the
    train side only, so the corpus is counted once (loom.data.describe)."""

    def __init__(self, base: PackedTokens, indices: list[int], owns_tokens: bool) -> None:
        self.base, self.indices = base, indices
        if owns_tokens:
            self.tokens = base.tokens

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base[self.indices[i]]


def split_windows(whole: PackedTokens, val_fraction: float) -> tuple[WindowSubset, WindowSubset | None]:
    """Every k-th window (k = round(1 / val_fraction), at least 2) to validation: deterministic
    and spread over the corpus."""
    k = max(2, round(1.0 / val_fraction)) if val_fraction > 0 else 0
    n = len(whole)
    train = [i for i in range(n) if not k or i % k != k - 1]
    val = [i for i in range(n) if k and i % k == k - 1]
    return WindowSubset(whole, train, owns_tokens=True), (WindowSubset(whole, val, owns_tokens=False) if val else None)


def file_token_datasets(ds: DictConfig, files: list[Path],
                        val_every: int | None = None) -> tuple[PackedTokens, PackedTokens | None]:
    """tinycode / text_files: one document per file, every `val_every`-th file to validation
    (`val_every`: the dataset's unless given)."""
    val_every = ds.val_every if val_every is None else val_every
    train, val = split(files, val_every)
    return token_datasets(ds.name, fingerprint(files, ds.max_bytes, val_every), ds.cache_dir, ds.seq_len,
                          Encoder(ds.get("tokenizer")), lambda: (f.read_bytes() for f in train),
                          lambda: (f.read_bytes() for f in val))
