"""`checkpoint.export_format=hf`: `final/` as a directory `transformers` loads with
`AutoModelForCausalLM.from_pretrained(final)`.

The layout is the one `save_pretrained` writes: `config.json`, the weights as
`model.safetensors` when they fit one shard of `checkpoint.export_shard_gb`, else
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` (its `weight_map` names
each tensor's shard), and the tokenizer's files when the run used one. The weights are streamed
one tensor at a time, as Loom's own export is (`safetensors_stream`): shards are planned from
the shapes before any tensor is gathered, so no rank holds the consolidated model. Each shard
carries `{"format": "pt"}` in its metadata: transformers 4 refuses a safetensors file whose
metadata lacks it (5 no longer checks).

Torch-free at module level (rundir/): torch is only touched through the tensors handed in.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from loom.atomic import atomic_path
from loom.rundir.safetensors_stream import SafetensorsStream, Spec, tensor_bytes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# What `save_pretrained` of a tokenizer writes (whichever exist are copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def plan_shards(specs: list[Spec], max_bytes: float) -> list[list[Spec]]:
    """Consecutive groups of `specs` of at most `max_bytes` each (a tensor larger than that
    alone in its shard), in order: what `save_pretrained(max_shard_size=...)` does."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        n = tensor_bytes(spec)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards if shards[0] else []


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(out: Path, specs: list[Spec], tensors: Iterable[tuple[str, Any]],
                  metadata: dict[str, str], max_bytes: float) -> list[Path]:
    """The weights into `out` as planned by `plan_shards`, each shard renamed into place when
    whole; the index last, when there are several. `tensors` yields `specs`' order."""
    shards = plan_shards(specs, max_bytes)
    names = shard_names(len(shards))
    stream: Iterator[tuple[str, Any]] = iter(tensors)
    paths = []
    for name, shard in zip(names, shards, strict=True):
        path = out / name
        with atomic_path(path) as tmp, SafetensorsStream(tmp, shard, {**metadata, "format": "pt"}) as writer:
            for _ in shard:
                key, tensor = next(stream)
                writer.write(key, tensor)
        paths.append(path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(tensor_bytes(s) for s in specs)},
                 "weight_map": {s[0]: name for name, shard in zip(names, shards, strict=True) for s in shard}}
        with atomic_path(out / INDEX) as tmp:
            tmp.write_text(json.dumps(index, indent=2) + "\n")
        paths.append(out / INDEX)
    return paths


def write_config(out: Path, config: dict[str, Any]) -> Path:
    path = out / "config.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def copy_tokenizer(out: Path, tokenizer_dir: str | Path | None) -> list[Path]:
    """The tokenizer's files beside the weights, so `AutoTokenizer.from_pretrained(final)` works."""
    if not tokenizer_dir or not Path(tokenizer_dir).is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            copied.append(Path(shutil.copyfile(src, out / name)))
    return copied


def write_hf_dir(out: Path, config: dict[str, Any], specs: list[Spec], tensors: Iterable[tuple[str, Any]],
                 metadata: dict[str, str], max_bytes: float, tokenizer_dir: str | Path | None = None) -> list[Path]:
    """config.json, the weights (sharded at `max_bytes`) and the tokenizer's files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / INDEX, out / SINGLE]:
        stale.unlink(missing_ok=True)  # a continued run re-exports: no shard of the last export may stay
    paths = write_weights(out, specs, tensors, metadata, max_bytes)
    return [write_config(out, config), *paths, *copy_tokenizer(out, tokenizer_dir)]
