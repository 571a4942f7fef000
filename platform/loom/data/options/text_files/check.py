"""`dataset=text_files`'s checks in the launcher: the patterns match text files, the corpus holds
at least one global batch of windows (byte level: known before tokenizing), its paths made
absolute (ranks and resumes may start elsewhere), and its validation split's size.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from loom.data.checks import absolute, corpus_val_size
from loom.data.files import expand, split
from loom.data.options.text_files.corpus import binary_files, corpus_files, window_split_every
from loom.errors import fail
from loom.layout import ParallelLayout


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
