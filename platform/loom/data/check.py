"""Dataset validation in the launcher (no torch): what can be checked before any process
starts is checked here, each failure a ConfigError naming the key, the value and the fix.

Cheap by design: globbing patterns, reading a local dataset's metadata or first record. A
hub dataset is opened from the local cache (the `datasets` library, no torch); a tokenizer's
vocabulary is read from its tokenizer.json (`tokenizers`, no torch).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from omegaconf import DictConfig

from loom.config import ConfigError
from loom.data import TOKEN_DATASETS, is_token_data

SYNTHETIC_KINDS = ("tokens", "tensors")


def _fail(key: str, value, rule: str) -> None:
    raise ConfigError(f"Invalid config: {key}={value!r}: {rule}.")


def _dp_size(cfg: DictConfig) -> int:
    world = cfg.hardware.devices * cfg.hardware.num_nodes
    tp = int(cfg.strategy.get("tensor_parallel", 1) or 1) if cfg.strategy.name == "fsdp_tp" else 1
    return max(1, world // tp)


@functools.lru_cache(maxsize=8)
def _tokenizer_vocab(name: str) -> int:
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


def data_vocab_size(cfg: DictConfig) -> int | None:
    """The token ids the data can hold (None: not token data)."""
    ds = cfg.dataset
    if not is_token_data(ds):
        return None
    if ds.name == "synthetic":
        return int(ds.vocab_size)
    return _tokenizer_vocab(str(ds.tokenizer)) if ds.get("tokenizer") else 256


def data_features(cfg: DictConfig) -> tuple[int, int] | None:
    """(input features, classes) of tensor data (None: token data)."""
    ds = cfg.dataset
    if ds.name == "digits":
        from loom.data.digits import N_CLASSES, N_FEATURES

        return N_FEATURES, N_CLASSES
    if ds.name == "synthetic" and ds.kind == "tensors":
        return math.prod(ds.shape), int(ds.num_classes)
    return None


def check_dataset(cfg: DictConfig) -> None:
    ds = cfg.dataset
    if "seq_len" in ds and ds.seq_len < 1:
        _fail("dataset.seq_len", ds.seq_len, "must be a positive integer (>= 1)")
    if "val_every" in ds and ds.val_every < 0:
        _fail("dataset.val_every", ds.val_every, "must be >= 0 (0: no validation split)")
    if ds.name in TOKEN_DATASETS and ds.get("tokenizer"):
        tok = Path(str(ds.tokenizer)).expanduser()
        if tok.is_dir():  # frozen absolute: ranks and resumes may start elsewhere
            ds.tokenizer = str(tok.resolve())
        data_vocab_size(cfg)
    if ds.name == "text_files":
        _check_text_files(cfg)
    elif ds.name == "hf":
        _check_hf(cfg)
    elif ds.name == "synthetic":
        _check_synthetic(cfg)


def _check_text_files(cfg: DictConfig) -> None:
    from loom.data.text_files import corpus_files, expand
    from loom.data.tinycode import split

    ds = cfg.dataset
    if not ds.paths:
        _fail("dataset.paths", list(ds.paths), "list at least one file or glob pattern, e.g. "
              "dataset.paths='[/data/corpus/**/*.txt]'")
    absolute = []
    for pat in ds.paths:
        if not expand(str(pat)):
            _fail("dataset.paths", str(pat), f"matches no files (resolved to {Path(str(pat)).expanduser().absolute()}); "
                  "fix the path or the glob (`**` matches directories recursively)")
        p = Path(str(pat)).expanduser()
        absolute.append(str(p if p.is_absolute() else Path.cwd() / p))
    ds.paths = absolute  # frozen absolute: ranks and resumes may start elsewhere
    if ds.max_bytes is not None and ds.max_bytes < 1:
        _fail("dataset.max_bytes", ds.max_bytes, "must be >= 1, or null for no cap")
    files = corpus_files(absolute, ds.max_bytes)
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        _fail("dataset.paths", list(ds.paths), f"the corpus is empty ({len(files)} file(s), 0 bytes); "
              "point it at files with text in them")
    if not ds.tokenizer:  # byte-level: the sequence count is known now
        train, _ = split(files, ds.val_every)
        n_bytes = sum(f.stat().st_size + 1 for f in train)
        seqs, need = max(0, (n_bytes - 1) // ds.seq_len), ds.batch_size * _dp_size(cfg)
        if seqs < need:
            _fail("dataset.paths", list(ds.paths),
                  f"the training corpus ({n_bytes:,} bytes in {len(train)} file(s)) packs into {seqs} "
                  f"sequences of dataset.seq_len={ds.seq_len}, fewer than one global batch ({need} = "
                  f"dataset.batch_size x {_dp_size(cfg)} ranks); add text or lower dataset.seq_len / "
                  "dataset.batch_size")


def _check_hf(cfg: DictConfig) -> None:
    from loom.data import hf

    ds = cfg.dataset
    if bool(ds.hub) == bool(ds.path):
        _fail("dataset.hub" if ds.hub else "dataset.path", ds.hub or ds.path,
              "set exactly one of dataset.hub (a Hugging Face hub dataset id, e.g. dataset.hub=wikitext "
              "dataset.config=wikitext-2-raw-v1) and dataset.path (a save_to_disk directory or local "
              ".json/.jsonl/.csv/.txt/.parquet files)")
    if ds.path:
        p = Path(str(ds.path)).expanduser()
        ds.path = str(p if p.is_absolute() else Path.cwd() / p)
        if not (p.exists() or hf.data_files(ds.path)):
            _fail("dataset.path", ds.path, "does not exist and matches no files")
        try:
            columns, rows = hf.local_columns(ds.path, ds.split)
        except (ValueError, OSError) as e:
            _fail("dataset.path", ds.path, str(e))
        where = f"dataset.path={ds.path}"
    else:
        hf.set_offline(ds)
        try:
            import datasets

            data = datasets.load_dataset(ds.hub, ds.config, split=ds.split)
        except Exception as e:
            reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            if not ds.online:
                raise ConfigError(
                    f"Invalid config: dataset.hub={ds.hub!r} (config {ds.config!r}, split {ds.split!r}) is not "
                    f"cached locally and Loom runs offline by default (HF_HUB_OFFLINE=1). Download it once "
                    f"with dataset.online=true, or point dataset.path at a local copy. ({reason})"
                ) from None
            raise ConfigError(f"Invalid config: dataset.hub={ds.hub!r} could not be loaded: {reason}.") from None
        columns, rows = list(data.column_names), data.num_rows
        where = f"dataset.hub={ds.hub}"
    if ds.text_column not in columns:
        _fail("dataset.text_column", ds.text_column,
              f"{where} has no such column; its columns: {', '.join(columns) or '(none)'}")
    if rows == 0:
        _fail("dataset.path" if ds.path else "dataset.hub", ds.path or ds.hub, "the dataset is empty (0 rows)")
    if ds.max_docs is not None and ds.max_docs < 1:
        _fail("dataset.max_docs", ds.max_docs, "must be >= 1, or null for every document")


def _check_synthetic(cfg: DictConfig) -> None:
    ds = cfg.dataset
    if ds.kind not in SYNTHETIC_KINDS:
        _fail("dataset.kind", ds.kind, f"valid choices: {', '.join(SYNTHETIC_KINDS)}")
    if ds.kind == "tensors":
        if not ds.shape or any(int(d) < 1 for d in ds.shape):
            _fail("dataset.shape", list(ds.shape), "list positive sizes, e.g. dataset.shape='[3,32,32]'")
        if ds.num_classes < 2:
            _fail("dataset.num_classes", ds.num_classes, "must be >= 2")
    elif ds.vocab_size < 2:
        _fail("dataset.vocab_size", ds.vocab_size, "must be >= 2")
    need = ds.batch_size * _dp_size(cfg)
    if ds.num_samples < need:
        _fail("dataset.num_samples", ds.num_samples,
              f"fewer than one global batch ({need} = dataset.batch_size x {_dp_size(cfg)} ranks)")
