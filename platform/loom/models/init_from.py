"""`model.init_from=<run dir | .safetensors file | Hugging Face dir>`: a new run that starts
from existing weights.

In the launcher (torch-free for Loom's own models): the source is resolved (a run dir means its
`final/model.safetensors`; a Hugging Face dir, its `model.safetensors` or the shards its
`model.safetensors.index.json` lists), frozen as an absolute path with a fingerprint of the
files (sizes and modification times, `model.init_from_fingerprint`, part of the run's identity:
another source, or the same files rewritten, is another run), and its tensors' names and
shapes, read from the safetensors headers (8 bytes little-endian length + JSON), are compared
with the model's before anything is launched. GPT, Llama and MLP shapes are written out from the
config; an `hf_causal_lm` or a custom nn.Module class is built on the meta device for its shapes
(this imports torch).

In the worker the weights go in through the same path as a fresh initialization
(`loom.models.init.FileInit`, a `NamedInit` that reads the file), so every strategy that
materializes by name (single, ddp, fsdp, fsdp_tp, zero1-3) loads them, each rank writing only
its own shards and never holding more than one full tensor of the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.errors import fail as _fail
from loom.models.family import ModelFamily, Shapes
from loom.rundir.paths import RunDir

HF_INDEX, HF_SINGLE = "model.safetensors.index.json", "model.safetensors"  # a Hugging Face dir's weights
MAX_LISTED = 8  # tensors named per kind of mismatch in the refusal


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: {name: {dtype, shape, data_offsets}}, no metadata."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"header length {n} is not plausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def source_file(value: str) -> Path:
    """The source `model.init_from` names: a run dir's final weights, a .safetensors file, or
    a Hugging Face directory (itself: its config.json and weight files are read from it)."""
    p = Path(value).expanduser().resolve()
    if p.is_dir():
        run = RunDir(p)
        if (run.final / "config.json").is_file():  # a run exported with checkpoint.export_format=hf
            return run.final
        if run.final_weights.is_file():
            return run.final_weights
        if (p / HF_INDEX).is_file() or (p / HF_SINGLE).is_file():
            return p
        _fail("model.init_from", value,
              f"is a directory without {RunDir.final_weights.rel} (a run dir has it once the run completed) nor "
              f"{HF_SINGLE} / {HF_INDEX} (a Hugging Face dir); name a completed run dir, a "
              "Hugging Face dir or a .safetensors file")
    if not p.is_file():
        _fail("model.init_from", value,
              "does not exist; name a completed run dir, a Hugging Face dir or a .safetensors file")
    return p


def tensor_files(path: Path) -> dict[str, Path]:
    """Each tensor's name -> the safetensors file holding it (a file: all in it; a Hugging
    Face dir: its single file, or the shards its index's `weight_map` names)."""
    if not path.is_dir():
        return {name: path for name in read_header(path)}
    if (path / HF_INDEX).is_file():
        weight_map = json.loads((path / HF_INDEX).read_text()).get("weight_map") or {}
        return {name: path / f for name, f in weight_map.items()}
    return {name: path / HF_SINGLE for name in read_header(path / HF_SINGLE)}


def fingerprint(path: Path) -> str:
    """Size and mtime of the file; of a Hugging Face dir: of its config.json, index and shards."""
    if not path.is_dir():
        st = path.stat()
        return f"size={st.st_size},mtime_ns={st.st_mtime_ns}"
    files = sorted({*tensor_files(path).values(), *(path / n for n in ("config.json", HF_INDEX))})
    stats = [f.stat() for f in files if f.is_file()]
    return (f"files={len(stats)},size={sum(st.st_size for st in stats)},"
            f"mtime_ns={max(st.st_mtime_ns for st in stats)}")


def normalize(cfg: DictConfig) -> None:
    """Freeze the resolved file and its fingerprint (the run's identity covers both)."""
    m = cfg.model
    if not m.get("init_from"):
        return
    path = source_file(str(m.init_from))
    m.init_from = str(path)
    m.init_from_fingerprint = fingerprint(path)


def mlp_shapes(m: DictConfig) -> Shapes:
    """loom.models.mlp: Sequential(Flatten, [Linear, GELU, Dropout] per hidden layer, Linear)."""
    widths = [int(m.in_features), *(int(h) for h in m.hidden), int(m.num_classes)]
    out: Shapes = {}
    for j, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        out[f"layers.{1 + 3 * j}.weight"], out[f"layers.{1 + 3 * j}.bias"] = (b, a), (b,)
    return out


def state_shapes(model: Any) -> Shapes:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def custom_shapes(cfg: DictConfig) -> Shapes:
    """A user's nn.Module class, built on the meta device (imports torch); a factory or a module
    instance builds its own weights, so loading into it is refused."""
    import torch

    from loom.models import custom

    target = cfg.model.module.get("_target_")
    kind = custom.kind_of(custom.locate(str(target)))
    if kind != "module":
        _fail("model.init_from", cfg.model.init_from,
              f"needs a model Loom builds; model.module._target_={target} is a {kind}, which "
              "builds its own weights: load them in it, or wrap an nn.Module class instead")
    with torch.device("meta"):
        return state_shapes(custom.instantiate(cfg.model.module))


def file_shapes(path: Path) -> Shapes:
    """Names and shapes in the file (a Hugging Face dir: in all its shards)."""
    shapes: Shapes = {}
    try:
        for f in sorted(set(tensor_files(path).values())):
            shapes |= {k: tuple(v["shape"]) for k, v in read_header(f).items()}
    except (OSError, ValueError) as e:
        raise ConfigError(f"Invalid config: model.init_from={str(path)!r}: not readable safetensors "
                          f"({e}).") from None
    return shapes


def mismatches(expected: Shapes, found: Shapes) -> list[str]:
    """One phrase per kind of mismatch, naming up to MAX_LISTED tensors each."""

    def listed(items: list[str]) -> str:
        more = f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
        return ", ".join(items[:MAX_LISTED]) + more

    shape = [f"{k} {list(found[k])} in the file, {list(v)} in the model"
             for k, v in expected.items() if k in found and tuple(found[k]) != tuple(v)]
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    out = []
    if shape:
        out.append(f"{len(shape)} shape mismatch(es): {listed(shape)}")
    if missing:
        out.append(f"{len(missing)} tensor(s) missing from the file: {listed(missing)}")
    if extra:
        out.append(f"{len(extra)} tensor(s) the model does not have: {listed(extra)}")
    return out


def _hint(path: Path, families: list[ModelFamily]) -> str:
    """The option that fits a Hugging Face dir: a family that reads its architecture, else
    hf_causal_lm, which loads the dir's weights itself (model.config, not model.init_from)."""
    if not path.is_dir():
        return "change the model overrides to match the source run's config.yaml"
    config = path / "config.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    able = [option for f in families if (option := f.hf_dir_option(data))]
    if able:
        return f"use model={able[0]}, which takes every field from the directory's config.json"
    return (f"use model=hf_causal_lm model.config={path} without model.init_from (it loads that "
            "directory's weights itself)")


def check(cfg: DictConfig, family: ModelFamily, families: list[ModelFamily]) -> None:
    """Refuse (exit 2) a source whose tensors do not fit the configured model (its family's
    `shapes` and `init_from_problems`), before launch; `families`: every registered one, for
    the hint."""
    m = cfg.model
    if not m.get("init_from"):
        return
    path = Path(str(m.init_from))
    found = file_shapes(path)
    fields = family.init_from_problems(cfg, path, found)
    problems = mismatches(family.shapes(cfg), found) or fields
    if problems:
        raise ConfigError(
            f"Invalid config: model.init_from={str(path)!r} does not fit model={m.name}: "
            f"{'; '.join(problems)}. Start from weights of the same architecture, or {_hint(path, families)}."
        )
