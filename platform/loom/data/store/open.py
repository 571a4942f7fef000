"""Open any token store Loom reads, as one stream of tokens: a Loom store directory (loom.json),
Megatron prefixes (one, or a directory of them), or a nanoGPT flat `.bin`.

Opening maps files and checks sizes against headers; it reads no array whole, so a store of
10^12 tokens opens in milliseconds. Per-shard offsets (one entry per shard) are the only arrays
built in memory.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loom.data.store.errors import FIX, StoreError
from loom.data.store.shards import FlatShard, IndexedShard, check_dtypes_agree, prefix_files
from loom.data.store.sidecar import PREPARE_DIR, SIDECAR, read_sidecar

FLAT_DTYPES = ("uint16", "uint32")
Shard = IndexedShard | FlatShard


@dataclass
class TokenStore:
    """All shards' tokens concatenated in order, addressed by global token offset."""

    path: Path | str  # a local path, or an object-store URL (a str)
    kind: str  # "loom", "megatron" or "flat"
    dtype: np.dtype
    shards: list[Shard]
    sidecar: dict[str, Any] | None = None
    n_tokens: int = field(init=False)
    n_docs: int | None = field(init=False)

    def __post_init__(self) -> None:
        self._starts = np.zeros(len(self.shards) + 1, np.int64)
        np.cumsum([s.n_tokens for s in self.shards], out=self._starts[1:])
        self.n_tokens = int(self._starts[-1])
        self._doc_base: np.ndarray | None = None
        self.n_docs = None
        if self.kind != "flat":
            self._doc_base = np.zeros(len(self.shards) + 1, np.int64)
            np.cumsum([s.n_docs for s in self.shards], out=self._doc_base[1:])
            self.n_docs = int(self._doc_base[-1])

    def _shard_of(self, offset: int) -> int:
        """The shard holding token `offset` (empty shards share their successor's start)."""
        return int(np.searchsorted(self._starts, offset, side="right")) - 1

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= self.n_tokens:
            raise IndexError(f"tokens [{start}, {end}) are outside {self.path} ({self.n_tokens:,} tokens)")

    def read(self, start: int, length: int) -> np.ndarray:
        """A fresh array of tokens [start, start+length), crossing shard boundaries."""
        start, length = operator.index(start), operator.index(length)
        if length < 0:
            raise IndexError(f"cannot read a negative length {length} from {self.path}")
        self._check_range(start, start + length)
        out = np.empty(length, self.dtype)
        pos, end, k = start, start + length, self._shard_of(start)
        while pos < end:
            base, stop = int(self._starts[k]), min(end, int(self._starts[k + 1]))
            out[pos - start:stop - start] = self.shards[k].tokens(pos - base, stop - base)
            pos, k = stop, k + 1
        return out

    def prefetch(self, start: int, length: int) -> None:
        """Tokens [start, start+length) will be read soon: a remote shard fetches them ahead."""
        end = min(start + length, self.n_tokens)
        k = self._shard_of(start) if 0 <= start < self.n_tokens else len(self.shards)
        while k < len(self.shards) and self._starts[k] < end:
            base = int(self._starts[k])
            self.shards[k].prefetch(max(start, base) - base, min(end, int(self._starts[k + 1])) - base)
            k += 1

    def doc_starts(self, start: int, end: int) -> np.ndarray:
        """Sorted unique int64 global offsets s where a document begins, start < s < end (flat: none)."""
        start, end = operator.index(start), operator.index(end)
        parts = []
        k = int(np.searchsorted(self._starts[1:], start, side="right"))  # first shard ending past start
        while k < len(self.shards) and self._starts[k] < end:
            base = int(self._starts[k])
            found = self.shards[k].doc_starts(start - base, end - base)
            if found.size:
                parts.append(found + base)
            k += 1
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def doc_at(self, offset: int) -> int:
        """The document (0-based over all shards) holding token `offset`, for messages; flat: 0."""
        offset = operator.index(offset)
        if not 0 <= offset < self.n_tokens:
            raise IndexError(f"token {offset} is outside {self.path} ({self.n_tokens:,} tokens)")
        if self._doc_base is None:
            return 0
        k = self._shard_of(offset)
        return int(self._doc_base[k]) + self.shards[k].doc_at(offset - int(self._starts[k]))

    def describe(self) -> str:
        """One line for launch output and `loom data inspect`."""
        docs = "documents unknown (no index)" if self.n_docs is None else f"{self.n_docs:,} documents"
        plural = "" if len(self.shards) == 1 else "s"
        return (f"{self.kind} store {self.path}: {len(self.shards)} shard{plural}, {docs}, "
                f"{self.n_tokens:,} tokens, {self.dtype.name}, {_tokenizer_words(self.sidecar)}")


def _tokenizer_words(sidecar: dict[str, Any] | None) -> str:
    if sidecar is None:
        return "no sidecar (written by another tool)"
    tok = sidecar.get("tokenizer")
    if isinstance(tok, dict):
        tok = tok.get("name") or tok.get("path")
    return f"tokenizer {tok}" if tok else "tokenizer not recorded"


def open_local(path: str | Path, dtype: str | None = None) -> TokenStore:
    """The store at `path`; `dtype` is for flat files only ("uint16" default, or "uint32"),
    indexed stores carry their own. Raises StoreError naming what was looked for."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _open_dir(p)
    idx, bin_ = prefix_files(p)
    if idx.is_file() and bin_.is_file():
        return _megatron(p, [p])
    if p.suffix in (".idx", ".bin") and p.is_file():
        prefix = p.with_suffix("")
        pidx, pbin = prefix_files(prefix)
        if pidx.is_file() and pbin.is_file():
            return _megatron(prefix, [prefix])
        if p.suffix == ".idx":
            raise StoreError(f"{p}: a Megatron index without its data file {pbin.name} beside it: {FIX}.")
        return _flat(p, dtype)
    if idx.is_file() or bin_.is_file():
        have, lack = (idx, bin_) if idx.is_file() else (bin_, idx)
        hint = f" (a flat nanoGPT token file? pass {bin_} itself)" if have == bin_ else ""
        raise StoreError(f"{p}: a Megatron prefix with {have.name} but no {lack.name}{hint}: {FIX}.")
    if p.exists():
        raise StoreError(f"{p}: not a token store: expected a store directory, a Megatron prefix "
                         f"(<prefix>.idx + <prefix>.bin) or a flat .bin token file.")
    raise StoreError(f"no token store at {p}: looked for a directory there (with {SIDECAR} or Megatron "
                     f".idx/.bin pairs), a Megatron prefix ({idx.name} + {bin_.name}) and a flat token file; "
                     f"none exists. Fix the path, or write a store with `loom data prepare ... --out {p}`.")


def _open_dir(d: Path) -> TokenStore:
    info = read_sidecar(d)
    if info is not None:
        return _loom(d, info)
    if (d / PREPARE_DIR).exists():
        raise StoreError(f"{d}: an interrupted `loom data prepare` (it holds {PREPARE_DIR}/ but no {SIDECAR}, "
                         "which is written last): run the same prepare again to resume; finished shards are kept.")
    idx_files = sorted(d.glob("*.idx"), key=lambda f: f.name)
    if idx_files:
        return _megatron(d, [f.with_suffix("") for f in idx_files])
    bins = sorted(f.name for f in d.glob("*.bin"))
    flat = (f"; it holds {len(bins)} .bin file(s) without an .idx (e.g. {bins[0]}): for a flat nanoGPT token "
            "file, pass the file's path") if bins else ""
    raise StoreError(f"{d}: no token store in this directory: looked for {SIDECAR} (a store written by "
                     f"`loom data prepare`) and Megatron <prefix>.idx/.bin pairs, found neither{flat}.")


def _loom(d: Path, info: dict[str, Any]) -> TokenStore:
    """A prepared store: exactly the shards its sidecar lists, each complete."""
    names = listed_shards(info, str(d))
    refuse_missing(str(d), names, [n for n in names if not all(f.is_file() for f in prefix_files(d / n))])
    shards = [IndexedShard(d / n) for n in names]
    return TokenStore(d, "loom", one_dtype(shards, d, info.get("dtype")), list(shards), info)


def listed_shards(info: dict[str, Any], where: str) -> list[str]:
    """The shard prefixes a sidecar lists (relative to the store)."""
    names = info.get("shards")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise StoreError(f"{where}/{SIDECAR}: 'shards' must be a list of shard prefixes relative to {where}, got "
                         f"{names!r}: re-run `loom data prepare` or re-copy the file.")
    return names


def refuse_missing(where: str, names: list[str], missing: list[str]) -> None:
    """A store whose sidecar lists shards that are not (all) there is refused, never read in part."""
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise StoreError(f"{where}: {SIDECAR} lists {len(names)} shards, but {len(missing)} lack their .idx or "
                         f".bin ({listed}): re-run `loom data prepare` (it resumes) or re-copy the whole directory.")


def one_dtype(shards: list, where: Path | str, declared: str | None) -> np.dtype:
    """The shards' dtype; a store with no shards takes the sidecar's (default uint16)."""
    found = check_dtypes_agree(shards, where)
    return found if found is not None else np.dtype(declared or "uint16")


def _megatron(path: Path, prefixes: list[Path]) -> TokenStore:
    shards = [IndexedShard(p) for p in prefixes]
    return TokenStore(path, "megatron", one_dtype(shards, path, None), list(shards))


def _flat(path: Path, dtype: str | None) -> TokenStore:
    name = dtype or FLAT_DTYPES[0]
    if name not in FLAT_DTYPES:
        raise StoreError(f"{path}: dtype={name!r} for a flat token file: it holds {' or '.join(FLAT_DTYPES)} "
                         "tokens; set the dtype the file was written with.")
    return TokenStore(path, "flat", np.dtype(name), [FlatShard(path, np.dtype(name))])
