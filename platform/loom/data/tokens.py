"""Byte-level token files on disk and the packed fixed-length dataset over them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


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


def build_token_file(files: list[Path], dest: Path) -> Path:
    """Concatenate the files' bytes (one token per byte) into `dest`, once.

    Written to a temporary name and renamed, so concurrent ranks never see half a file and
    a second run reuses the cache instead of re-tokenizing.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as out:
        for f in files:
            out.write(f.read_bytes())
            out.write(b"\n")
    os.replace(tmp, dest)
    return dest


class PackedTokens(Dataset):
    """Non-overlapping windows of seq_len+1 tokens over one memory-mapped token file."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.tokens = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.n = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]
