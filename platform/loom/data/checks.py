"""The checks every dataset option shares, in the launcher (no torch): the common fields, the
tokenizer, the validation split's size; each failure a ConfigError naming the key, the value and
the fix. An option's own checks live in its module (loom.data.options); this module names none.

Cheap by design: a tokenizer's vocabulary is read from its tokenizer.json (`tokenizers`, no torch).
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import ConfigError, fail


def absolute(path: str) -> str:
    """A path made absolute: ranks and resumes may start in another directory."""
    p = Path(str(path)).expanduser()
    return str(p if p.is_absolute() else Path.cwd() / p)


@functools.lru_cache(maxsize=8)
def tokenizer_vocab(name: str) -> int:
    from loom.data.tokenizer import TokenizerUnavailable, tokenizer_vocab_size

    try:
        return tokenizer_vocab_size(name)
    except TokenizerUnavailable as e:
        raise ConfigError(
            f"Invalid config: dataset.tokenizer={name!r} is not available locally ({e}). Loom loads "
            "tokenizers with local_files_only=True: pass a directory holding the tokenizer files "
            "(save_pretrained), or a name already in the Hugging Face cache; or dataset.tokenizer=null "
            "for byte-level tokens (vocab 256, no download)."
        ) from None


def normalize_tokenizer(ds: DictConfig) -> None:
    if ds.get("tokenizer"):
        tok = Path(str(ds.tokenizer)).expanduser()
        if tok.is_dir():
            ds.tokenizer = str(tok.resolve())


def check_common(ds: DictConfig, packings: tuple[str, ...] = ("concat", "documents")) -> None:
    if ds.batch_size < 1:
        fail("dataset.batch_size", ds.batch_size, "must be a positive integer (>= 1)")
    if "seq_len" in ds and ds.seq_len < 1:
        fail("dataset.seq_len", ds.seq_len, "must be a positive integer (>= 1)")
    if "packing" in ds and ds.packing not in packings:
        fail("dataset.packing", ds.packing, f"valid choices: {', '.join(packings)} (documents: attention never "
             "crosses a document boundary, positions restart at each document)")
    if "val_every" in ds and ds.val_every < 0:
        fail("dataset.val_every", ds.val_every, "must be >= 0 (0: no validation split)")


def val_every(ds: DictConfig) -> int | None:
    """0 when the split is turned off (dataset.val_every <= 1), else None (go on counting)."""
    every = ds.get("val_every")
    return 0 if every is not None and every <= 1 else None


def corpus_val_size(ds: DictConfig, files: list[Path], k: int | None = None) -> int | None:
    """Validation windows of a byte-level corpus of `files` (every val_every-th file, or every
    k-th window when the option splits by window: too few files); None when a tokenizer decides
    (only the workers, after tokenizing, can tell)."""
    from loom.data.files import split

    off = val_every(ds)
    if off is not None:
        return off
    if k is not None:  # every k-th window of the whole corpus
        n_bytes = sum(f.stat().st_size + 1 for f in files)
        return None if ds.tokenizer else max(0, (n_bytes - 1) // ds.seq_len) // k
    _, val = split(files, ds.val_every)
    if not val or ds.tokenizer:
        return 0 if not val else None
    n_bytes = sum(f.stat().st_size + 1 for f in val)  # byte level: each file and a newline
    return (n_bytes - 1) // ds.seq_len if n_bytes > ds.seq_len else 0


def val_problem(cfg: DictConfig, n_val: int, dp: int) -> str | None:
    """Why a validation split of `n_val` samples/windows validates nothing (None: it is fine).
    The val loader drops a rank's last partial batch, so fewer than one batch per data-parallel
    rank is as good as empty."""
    ds = cfg.dataset
    if n_val == 0:
        every = ds.get("val_every", 2)
        how = (f"dataset.val_every={every} puts none of the data in it" if every > 1
               else f"dataset.val_every={every} turns it off")
        return f"dataset={ds.name}: the validation split is empty ({how})"
    if n_val // dp < ds.batch_size:
        return (f"dataset={ds.name}: the validation split has {n_val} sample(s)/window(s), fewer than one "
                f"batch per data-parallel rank (dataset.batch_size={ds.batch_size} x {dp} ranks): "
                "validation would not run")
    return None
