"""Dataset checks in the launcher (no torch): what can be checked before any process starts is
checked here, each failure a ConfigError naming the key, the value and the fix; and the
normalization a dataset needs (paths made absolute: ranks and resumes may start elsewhere).

Cheap by design: globbing patterns, reading a local dataset's metadata or first record. A
hub dataset is opened from the local cache (the `datasets` library, no torch); a tokenizer's
vocabulary is read from its tokenizer.json (`tokenizers`, no torch).
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout

SYNTHETIC_KINDS = ("tokens", "tensors")


def _absolute(path: str) -> str:
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


def normalize_text_files(cfg: DictConfig) -> None:
    cfg.dataset.paths = [_absolute(p) for p in cfg.dataset.paths]


def check_text_files(cfg: DictConfig, layout: ParallelLayout) -> None:
    from loom.data.files import expand, split
    from loom.data.text_files import binary_files, corpus_files, window_split_every

    ds = cfg.dataset
    if not ds.paths:
        fail("dataset.paths", list(ds.paths), "list at least one file or glob pattern, e.g. "
             "dataset.paths='[/data/corpus/**/*.txt]'")
    for pat in ds.paths:
        if not expand(str(pat)):
            fail("dataset.paths", str(pat), f"matches no files (resolved to {Path(str(pat)).expanduser().absolute()}); "
                 "fix the path or the glob (`**` matches directories recursively)")
    if ds.max_bytes is not None and ds.max_bytes < 1:
        fail("dataset.max_bytes", ds.max_bytes, "must be >= 1, or null for no cap")
    files = corpus_files(list(ds.paths), ds.max_bytes)
    binary = binary_files(files)
    if binary:
        fail("dataset.paths", list(ds.paths), f"{len(binary)} file(s) are not text, e.g. {binary[0]}: "
             "dataset=text_files reads text, one document per file. Token files (a nanoGPT .bin, a "
             "Megatron .bin/.idx prefix) train with dataset=tokens dataset.mix='[PATH]'")
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        fail("dataset.paths", list(ds.paths), f"the corpus is empty ({len(files)} file(s), 0 bytes); "
             "point it at files with text in them")
    fraction = ds.get("val_fraction")
    if fraction is not None and not 0 < fraction < 1:
        fail("dataset.val_fraction", fraction, "must be between 0 and 1 (the share of windows held out "
             "for validation when the corpus has fewer files than dataset.val_every), or null")
    if not ds.tokenizer:  # byte-level: the sequence count is known now
        k = window_split_every(ds, len(files))
        train, _ = split(files, ds.val_every if k is None else 0)
        n_bytes = sum(f.stat().st_size + 1 for f in train)
        seqs, need = max(0, (n_bytes - 1) // ds.seq_len), ds.batch_size * layout.dp
        seqs -= seqs // k if k else 0
        if seqs < need:
            fail("dataset.paths", list(ds.paths),
                 f"the training corpus ({n_bytes:,} bytes in {len(train)} file(s)) packs into {seqs} "
                 f"sequences of dataset.seq_len={ds.seq_len}, fewer than one global batch ({need} = "
                 f"dataset.batch_size x {layout.dp} ranks); add text or lower dataset.seq_len / "
                 "dataset.batch_size")


def normalize_hf(cfg: DictConfig) -> None:
    if cfg.dataset.path:
        cfg.dataset.path = _absolute(cfg.dataset.path)


def check_hf(cfg: DictConfig, layout: ParallelLayout) -> None:
    ds = cfg.dataset
    if bool(ds.hub) == bool(ds.path):
        fail("dataset.hub" if ds.hub else "dataset.path", ds.hub or ds.path,
             "set exactly one of dataset.hub (a Hugging Face hub dataset id, e.g. dataset.hub=wikitext "
             "dataset.config=wikitext-2-raw-v1) and dataset.path (a save_to_disk directory or local "
             ".json/.jsonl/.csv/.txt/.parquet files)")
    columns, rows, where = _hf_local(ds) if ds.path else _hf_hub(ds)
    if ds.text_column not in columns:
        fail("dataset.text_column", ds.text_column,
             f"{where} has no such column; its columns: {', '.join(columns) or '(none)'}")
    if rows == 0:
        fail("dataset.path" if ds.path else "dataset.hub", ds.path or ds.hub, "the dataset is empty (0 rows)")
    if ds.path and _column_is_text(ds) is False:
        fail("dataset.text_column", ds.text_column, "holds lists or records, not text: it would be trained as "
             "their Python repr. Conversations (a list of {role, content}) train with dataset=chat (the chat "
             "template, assistant-only loss); otherwise name a text column")
    if ds.max_docs is not None and ds.max_docs < 1:
        fail("dataset.max_docs", ds.max_docs, "must be >= 1, or null for every document")


def _column_is_text(ds: DictConfig) -> bool | None:
    from loom.data import hf

    try:
        return hf.column_is_text(ds.path, ds.split, ds.text_column)
    except (OSError, ValueError, KeyError):
        return None


def _hf_local(ds: DictConfig) -> tuple[list[str], int | None, str]:
    from loom.data import hf

    if not (Path(ds.path).exists() or hf.data_files(ds.path)):
        fail("dataset.path", ds.path, "does not exist and matches no files")
    try:
        columns, rows = hf.local_columns(ds.path, ds.split)
    except (ValueError, OSError) as e:
        fail("dataset.path", ds.path, str(e))
    return columns, rows, f"dataset.path={ds.path}"


def _hf_hub(ds: DictConfig) -> tuple[list[str], int | None, str]:
    from loom.data import hf

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
    return list(data.column_names), data.num_rows, f"dataset.hub={ds.hub}"


def check_synthetic(cfg: DictConfig, layout: ParallelLayout) -> None:
    ds = cfg.dataset
    if ds.kind not in SYNTHETIC_KINDS:
        fail("dataset.kind", ds.kind, f"valid choices: {', '.join(SYNTHETIC_KINDS)}")
    if ds.kind == "tensors":
        if not ds.shape or any(int(d) < 1 for d in ds.shape):
            fail("dataset.shape", list(ds.shape), "list positive sizes, e.g. dataset.shape='[3,32,32]'")
        if ds.num_classes < 2:
            fail("dataset.num_classes", ds.num_classes, "must be >= 2")
    elif ds.vocab_size < 2:
        fail("dataset.vocab_size", ds.vocab_size, "must be >= 2")
    need = ds.batch_size * layout.dp
    if ds.num_samples < need:
        fail("dataset.num_samples", ds.num_samples,
             f"fewer than one global batch ({need} = dataset.batch_size x {layout.dp} ranks)")


DIGITS_SAMPLES = 1797  # loom.data.digits.N_SAMPLES (that module imports torch)


def val_every(ds: DictConfig) -> int | None:
    """0 when the split is turned off (dataset.val_every <= 1), else None (go on counting)."""
    every = ds.get("val_every")
    return 0 if every is not None and every <= 1 else None


def digits_val_size(ds: DictConfig) -> int | None:
    off = val_every(ds)
    return off if off is not None else DIGITS_SAMPLES // ds.val_every


def synthetic_val_size(ds: DictConfig) -> int | None:
    return max(1, ds.num_samples // 16)  # loom.data.synthetic


def corpus_val_size(ds: DictConfig, files: list[Path]) -> int | None:
    """Validation windows of a byte-level corpus of `files` (every val_every-th file, or every
    k-th window when there are too few files); None when a tokenizer decides (only the workers,
    after tokenizing, can tell)."""
    from loom.data.files import split
    from loom.data.text_files import window_split_every

    off = val_every(ds)
    if off is not None:
        return off
    k = window_split_every(ds, len(files))
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
