"""The front end the rendering options share (dataset=chat, dataset=preference): the run's template,
its paths frozen absolute, the checks every rendered source needs (a source, the model's tokenizer, a
template that renders), the inputs a cache entry is keyed by, and that entry's place. No torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.data.conversation.template import ChatTemplate, TemplateError, load_template
from loom.data.fingerprint import DataInputs
from loom.errors import ConfigError, fail
from loom.layout import ParallelLayout


def template_of(ds: DictConfig) -> ChatTemplate:
    try:
        return load_template(ds.get("tokenizer"), ds.get("chat_template"))
    except TemplateError as e:
        raise ConfigError(f"Invalid config: dataset.chat_template={ds.get('chat_template')!r}: {e}") from None


def normalize_paths(cfg: DictConfig) -> None:
    """dataset.path and dataset.chat_template frozen absolute (ranks and resumes may start elsewhere)."""
    from loom.data.checks import absolute

    ds = cfg.dataset
    for key in ("path", "chat_template"):
        if ds.get(key):
            ds[key] = absolute(str(ds[key]))


def check_front(ds: DictConfig, layout: ParallelLayout, rows: str, pipeline: str,
                examples: list[list[dict]]) -> None:
    """A source (`rows`: what its rows hold), the tokenizer, no pipeline stages (`pipeline`: why), and a
    template that renders each of `examples` (a conversation; one ending on a user turn is rendered with
    the generation prompt), in a second."""
    name = ds.name
    if not ds.path and not ds.hub:
        fail("dataset.path", ds.path, f"give the {rows}")
    if not ds.get("tokenizer"):
        fail("dataset.tokenizer", None, f"dataset={name} needs the model's tokenizer (a local Hugging Face "
             "tokenizer directory): its chat template and ids")
    if layout.pp > 1:
        fail("strategy.pp", layout.pp, f"dataset={name} {pipeline}: use fsdp, ddp, zero* or fsdp_tp")
    template = template_of(ds)
    try:
        for messages in examples:
            template.render(messages, add_generation_prompt=messages[-1]["role"] == "user")
    except TemplateError as e:
        fail("dataset.chat_template" if ds.get("chat_template") else "dataset.tokenizer",
             ds.get("chat_template") or ds.tokenizer, str(e))


def inputs(ds: DictConfig) -> DataInputs:
    from loom.data.prepare.hf_source import source_files

    files = source_files(ds.path) if ds.path else []
    extra = [Path(ds.chat_template)] if ds.get("chat_template") else []
    return DataInputs(files=list(files) + extra)


def cache_entry(ds: DictConfig, kind: str, spec: tuple) -> Path:
    """The cache entry of a rendered source: `<kind>-<key>-<tokenizer>`, the key over its input files
    (or its hub source), the option's `spec` and the template's text and special tokens."""
    from loom.data.cache import cache_root, fingerprint
    from loom.data.prepare import tokenizer_fingerprint
    from loom.data.prepare.hf_source import source_key

    template = template_of(ds)
    files = [f for f in inputs(ds).files if f.is_file()] if ds.path else []
    key = fingerprint(files, *spec, hashlib.sha1(template.text.encode()).hexdigest(), sorted(template.special.items()),
                      None if ds.path else source_key(ds, None))
    return cache_root(ds.get("cache_dir")) / f"{kind}-{key}-{tokenizer_fingerprint(str(ds.tokenizer))[:12]}"


def render_splits(ds: DictConfig, root: Path, splits: tuple[str, ...], writer: Callable[[Path, Any], Any],
                  render_into: Callable[[DictConfig, dict, ChatTemplate, Any], int]) -> None:
    """Every row of the source rendered into its split's writer (`writer(split_dir, token_spec)`, with
    `abort()` and `finish(ds, template, split, counted)`); `render_into` returns the rows it dropped and
    counted, which each split's sidecar records. A failure aborts every split."""
    from loom.data.prepare import token_spec
    from loom.data.prepare.encoding import load_backend

    template, spec = template_of(ds), token_spec(str(ds.tokenizer))
    tokenizer, _ = load_backend(str(ds.tokenizer))
    out = {s: writer(root / s, spec) for s in splits}
    try:
        counted = render_into(ds, out, template, tokenizer)
    except BaseException:
        for w in out.values():
            w.abort()
        raise
    for s, w in out.items():
        w.finish(ds, template, s, counted)
