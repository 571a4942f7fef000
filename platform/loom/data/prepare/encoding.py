"""The tokenizer a prepare encodes with, loaded without torch.

`transformers` imports torch (seconds, and `loom data` must not), so a fast tokenizer's
`tokenizer.json` is read with the `tokenizers` library and its EOS from the tokenizer's config
files; only a tokenizer without a `tokenizer.json` goes through transformers. The ids are the
same as `loom.data.tokens.Encoder`'s (its `tok(texts, add_special_tokens=False)` runs the same
backend), and so is the fingerprint, so a store can be compared with a run's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom.data.tokenizer import TokenizerUnavailable, _cached_file, load_tokenizer
from loom.errors import ConfigError

BYTES = "bytes"  # the fingerprint of byte-level tokens (no tokenizer)


@dataclass(frozen=True)
class TokenSpec:
    """What the shards depend on: picklable, so workers load the same tokenizer by name."""

    name: str | None
    fingerprint: str
    vocab_size: int
    eos_id: int | None
    dtype: str


def normalize_name(name: str | None) -> str | None:
    """A local tokenizer directory as its resolved path (as a run's config normalizes it), so
    the fingerprint does not depend on how the directory was spelled."""
    if not name:
        return None
    p = Path(name).expanduser()
    return str(p.resolve()) if p.is_dir() else name


def _eos_token(name: str) -> str | None:
    """The EOS token's text from tokenizer_config.json or special_tokens_map.json."""
    for filename in ("tokenizer_config.json", "special_tokens_map.json"):
        f = _cached_file(name, filename)
        if f is None:
            continue
        eos = json.loads(f.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def load_backend(name: str) -> tuple[Any, int | None]:
    """(the `tokenizers.Tokenizer`, the EOS id or None) of a local or cached tokenizer."""
    tj = _cached_file(name, "tokenizer.json")
    if tj is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tj))
        eos = _eos_token(name)
        return tok, (tok.token_to_id(eos) if eos is not None else None)
    local = Path(name).expanduser()
    known = local.is_dir() or any(_cached_file(name, f) is not None
                                  for f in ("tokenizer_config.json", "tokenizer.model", "vocab.json"))
    try:  # no tokenizer.json: transformers converts a slow tokenizer (this imports torch)
        if not known:  # not here at all: say so without transformers (or the network)
            raise TokenizerUnavailable(f"{name} is neither a directory nor in the Hugging Face cache")
        hf = load_tokenizer(name)
    except TokenizerUnavailable as e:
        raise ConfigError(
            f"Invalid usage: --tokenizer {name}: no such tokenizer here ({e}). Give a local directory "
            "holding tokenizer.json (a Hugging Face tokenizer saved with save_pretrained) or the name "
            "of one already in the Hugging Face cache; omit --tokenizer for byte-level tokens.") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"Invalid usage: --tokenizer {name} has no fast (Rust) tokenizer to encode with.")
    return backend, hf.eos_token_id


def _fingerprint_of(name: str, tok: Any) -> str:
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items())
    return hashlib.sha1(repr((name, vocab)).encode()).hexdigest()[:12]


def tokenizer_fingerprint(name: str | None) -> str:
    """THE tokenizer fingerprint: sha1 of (name, sorted vocabulary), as Encoder.key(); "bytes"
    for byte-level. Stores record it; a run compares its tokenizer's with a store's."""
    name = normalize_name(name)
    if name is None:
        return BYTES
    return _fingerprint_of(name, load_backend(name)[0])


def optimal_dtype_name(vocab_size: int | None) -> str:
    from loom.data.store import optimal_dtype

    return np.dtype(optimal_dtype(vocab_size)).name


def token_spec(name: str | None) -> TokenSpec:
    """The tokenizer's identity, vocabulary size, EOS and the shards' dtype (ConfigError if absent)."""
    name = normalize_name(name)
    if name is None:
        return TokenSpec(None, BYTES, 256, None, optimal_dtype_name(None))
    tok, eos = load_backend(name)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return TokenSpec(name, _fingerprint_of(name, tok), vocab, eos, optimal_dtype_name(vocab))


class DocEncoder:
    """Documents to token arrays with the tokenizers library's own batch encoder (no offsets,
    no attention masks), the EOS id appended; byte level: UTF-8 bytes and a newline."""

    def __init__(self, spec: TokenSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self.tok = load_backend(spec.name)[0] if spec.name else None
        if self.tok is not None:
            self.batch = getattr(self.tok, "encode_batch_fast", None) or self.tok.encode_batch
        self.eos = [] if spec.eos_id is None else [spec.eos_id]

    def ids(self, text: str) -> list[int]:
        """One text's ids as the batch encoder gives them (no EOS)."""
        return self.batch([text], add_special_tokens=False)[0].ids

    def encode_long(self, text: str, max_whole_chars: int) -> np.ndarray:
        """One long document's array, tokenized in checked pieces (loom.data.prepare.pieces says
        why); raises pieces.Uncuttable above `max_whole_chars` where it cannot be cut."""
        if self.tok is None:
            return self.encode([text])[0]
        from loom.data.prepare.pieces import encode_pieces

        parts = [np.array(ids, dtype=self.dtype) for ids in encode_pieces(self.ids, text, max_whole_chars)]
        return np.concatenate([*parts, np.array(self.eos, dtype=self.dtype)])

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.tok is None:
            return [np.frombuffer(t.encode() + b"\n", dtype=np.uint8) for t in texts]
        dtype, eos = self.dtype, self.eos
        return [np.array(e.ids + eos, dtype=dtype) for e in self.batch(texts, add_special_tokens=False)]
