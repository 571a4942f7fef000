"""Hugging Face tokenizers, from local files only (a directory, or a name in the HF cache).

Validation wants the vocabulary size before torch is imported (transformers imports torch):
a fast tokenizer's `tokenizer.json` is read with the `tokenizers` library (no torch); only a
tokenizer without one (a slow, sentencepiece-only tokenizer) loads transformers there.
"""

from __future__ import annotations

from pathlib import Path


class TokenizerUnavailable(Exception):
    pass


def _cached_file(name: str, filename: str) -> Path | None:
    """`filename` of `name`: a local directory's file, or the HF hub cache's copy (no network)."""
    local = Path(name).expanduser()
    if local.is_dir():
        f = local / filename
        return f if f.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, filename)
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def tokenizer_vocab_size(name: str) -> int:
    """len(tokenizer) (base vocabulary + added tokens), preferring the torch-free path."""
    tj = _cached_file(name, "tokenizer.json")
    if tj is not None:
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(tj)).get_vocab_size(with_added_tokens=True)
        except Exception:
            pass
    return len(load_tokenizer(name))


def load_tokenizer(name: str):
    """AutoTokenizer.from_pretrained(name, local_files_only=True); TokenizerUnavailable if absent."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(Path(name).expanduser()) if Path(name).expanduser().is_dir()
                                             else name, local_files_only=True)
    except Exception as e:  # OSError / ValueError / HF hub errors: not available locally
        raise TokenizerUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
