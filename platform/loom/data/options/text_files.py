"""`dataset=text_files`: your own text corpus, by glob patterns (no torch here: validation
globs the patterns, so a pattern that matches nothing is refused before any process starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from loom.data.checks import absolute, corpus_val_size
from loom.data.files import expand, first_bytes, split
from loom.data.fingerprint import DataInputs
from loom.data.option import DatasetOption, always
from loom.errors import fail
from loom.layout import ParallelLayout


@dataclass
class TextFilesDatasetConfig:
    name: str = "text_files"
    batch_size: int = 16
    seq_len: int = 128
    packing: str = "concat"           # concat | documents (no attention across documents)
    paths: list[str] = field(default_factory=list)  # files or glob patterns (`**` recursive)
    max_bytes: int | None = None      # cap on the corpus size (first files in sorted order)
    val_every: int = 20               # every Nth file goes to validation (0: none)
    # fewer files than val_every: this fraction of the windows is validation (every
    # round(1/val_fraction)-th window; null: 1/val_every)
    val_fraction: float | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None


def corpus_files(patterns: list[str], max_bytes: int | None = None) -> list[Path]:
    """Every file the patterns match, deduplicated, in sorted order, capped at `max_bytes`."""
    files = sorted({f.resolve() for pat in patterns for f in expand(pat)}, key=str)
    return first_bytes(files, max_bytes)


TOKEN_SUFFIXES = (".bin", ".idx", ".npy")  # token files (nanoGPT, Megatron), never text


def binary_files(files: list[Path], sniff: int = 200) -> list[Path]:
    """Files that are not text: a token file's suffix, or a NUL byte in the first 4 KB (of the
    first `sniff` files: validation stays quick on a corpus of millions of files)."""
    found = [f for f in files if f.suffix in TOKEN_SUFFIXES]
    for f in files[:sniff]:
        if f not in found:
            with open(f, "rb") as fh:
                if b"\x00" in fh.read(4096):
                    found.append(f)
    return found


def inputs(ds: DictConfig) -> DataInputs:
    return DataInputs(files=corpus_files(list(ds.paths), ds.max_bytes))


def source(ds: DictConfig) -> str:
    return f"{len(corpus_files(list(ds.paths), ds.max_bytes))} file(s) from {', '.join(map(str, ds.paths))}"


def window_split_every(ds: DictConfig, n_files: int) -> int | None:
    """k when validation is every k-th window (fewer files than val_every), else None."""
    if ds.val_every <= 1 or n_files >= ds.val_every:
        return None
    fraction = ds.get("val_fraction") or 1.0 / ds.val_every
    return max(2, round(1.0 / fraction))


def stores(cfg: DictConfig, workers: int | None = 1) -> dict[str, object]:
    """The train and val token stores (one store when validation is by window), prepared into
    the cache where missing."""
    from loom.data.tokens import file_stores

    ds = cfg.dataset
    files = corpus_files(list(ds.paths), ds.max_bytes)
    by_window = window_split_every(ds, len(files)) is not None
    return file_stores(ds, files, 0 if by_window else ds.val_every, workers)


def datasets(cfg: DictConfig):
    """(train, val) token windows. Validation is every `val_every`-th file; a corpus of fewer
    files than that (a few big books) would get none, so then it is every k-th window of all
    files instead (k = round(1 / val_fraction))."""
    from loom.data.tokens import front_end_datasets

    ds = cfg.dataset
    k = window_split_every(ds, len(corpus_files(list(ds.paths), ds.max_bytes)))
    return front_end_datasets(cfg, stores(cfg), val_every_window=k)


def normalize(cfg: DictConfig) -> None:
    cfg.dataset.paths = [absolute(p) for p in cfg.dataset.paths]


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
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


def val_size(ds: DictConfig) -> int | None:
    files = corpus_files(list(ds.paths), ds.max_bytes)
    return corpus_val_size(ds, files, window_split_every(ds, len(files)))


OPTION = DatasetOption(TextFilesDatasetConfig, "loom.data.options.text_files:datasets", always(True), inputs, source,
                       tokenized=True, stores=stores, check=check, normalize=normalize, val_size=val_size,
                       where=lambda ds: ", ".join(map(str, ds.paths)) or None)
