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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.errors import fail as _fail
from loom.models import llama_hf
from loom.models.schema import LLAMA_OPTIONS

FINAL = Path("final") / "model.safetensors"
HF_INDEX, HF_SINGLE = "model.safetensors.index.json", "model.safetensors"  # a Hugging Face dir's weights
Shapes = dict[str, tuple[int, ...]]
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
        if (p / FINAL.parent / "config.json").is_file():  # a run exported with checkpoint.export_format=hf
            return p / FINAL.parent
        if (p / FINAL).is_file():
            return p / FINAL
        if (p / HF_INDEX).is_file() or (p / HF_SINGLE).is_file():
            return p
        _fail("model.init_from", value,
              f"is a directory without {FINAL} (a run dir has it once the run completed) nor "
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


def gpt_shapes(m: DictConfig) -> Shapes:
    """loom.models.gpt's state_dict, from the config (a test checks it against the module)."""
    d, V, T = int(m.d_model), int(m.vocab_size), int(m.block_size)
    out: Shapes = {"wte.weight": (V, d), "wpe.weight": (T, d)}
    for i in range(int(m.n_layer)):
        b = f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{b}{ln}.weight"], out[f"{b}{ln}.bias"] = (d,), (d,)
        out |= {f"{b}attn.qkv.weight": (3 * d, d), f"{b}attn.qkv.bias": (3 * d,),
                f"{b}attn.proj.weight": (d, d), f"{b}attn.proj.bias": (d,),
                f"{b}mlp.fc.weight": (4 * d, d), f"{b}mlp.fc.bias": (4 * d,),
                f"{b}mlp.proj.weight": (d, 4 * d), f"{b}mlp.proj.bias": (d,)}
    return out | {"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (V, d)}


def mlp_shapes(m: DictConfig) -> Shapes:
    """loom.models.mlp: Sequential(Flatten, [Linear, GELU, Dropout] per hidden layer, Linear)."""
    widths = [int(m.in_features), *(int(h) for h in m.hidden), int(m.num_classes)]
    out: Shapes = {}
    for j, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        out[f"layers.{1 + 3 * j}.weight"], out[f"layers.{1 + 3 * j}.bias"] = (b, a), (b,)
    return out


def _state_shapes(model: Any) -> Shapes:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def hf_shapes(cfg: DictConfig) -> Shapes:
    """A transformers architecture's state dict, built on the meta device (imports torch)."""
    import torch
    from transformers import AutoModelForCausalLM

    from loom.models import hf

    with torch.device("meta"):
        return _state_shapes(AutoModelForCausalLM.from_config(hf.auto_config(cfg.model)))


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
        return _state_shapes(custom.instantiate(cfg.model.module))


def file_shapes(path: Path) -> Shapes:
    """Names and shapes in the file (a Hugging Face dir: in all its shards); older GPT weights'
    separate attn.q/k/v count as the fused attn.qkv they load as (loom.models.gpt)."""
    shapes: Shapes = {}
    try:
        for f in sorted(set(tensor_files(path).values())):
            shapes |= {k: tuple(v["shape"]) for k, v in read_header(f).items()}
    except (OSError, ValueError) as e:
        raise ConfigError(f"Invalid config: model.init_from={str(path)!r}: not readable safetensors "
                          f"({e}).") from None
    for k in [k for k in shapes if k.endswith(".attn.q.weight") or k.endswith(".attn.q.bias")]:
        prefix, kind = k.rsplit(".q.", 1)
        parts = [f"{prefix}.{n}.{kind}" for n in "qkv"]
        if all(p in shapes for p in parts) and f"{prefix}.qkv.{kind}" not in shapes:
            q = shapes[parts[0]]
            for p in parts:
                shapes.pop(p)
            shapes[f"{prefix}.qkv.{kind}"] = (3 * q[0], *q[1:])
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


def _llama_problems(m: DictConfig, path: Path, found: Shapes) -> list[str]:
    """A Llama from a Hugging Face dir: a tied head stored anyway is dropped from `found` (never
    read); once the tensors fit, a sized option's shape-free fields must agree with config.json."""
    data = llama_hf.read_config(path) if path.is_dir() else None
    if data is None:
        return []
    fields = llama_hf.fields_from_config(data, str(path))
    if fields["tie_embeddings"] and m.tie_embeddings:
        found.pop("lm_head.weight", None)
    if m.name == "llama" or mismatches(llama_hf.llama_shapes(m), found):
        return []
    return llama_hf.field_mismatches(m, fields)


def _hint(name: str, path: Path) -> str:
    """The option that fits a Hugging Face dir: Loom's Llama for its architectures, else
    hf_causal_lm, which loads the dir's weights itself (model.config, not model.init_from)."""
    if not path.is_dir():
        return "change the model overrides to match the source run's config.yaml"
    data = llama_hf.read_config(path) or {}
    if (data.get("architectures") or [None])[0] in llama_hf.SUPPORTED:
        return "use model=llama, which takes every field from the directory's config.json"
    return (f"use model=hf_causal_lm model.config={path} without model.init_from (it loads that "
            "directory's weights itself)")


def check(cfg: DictConfig, expected_shapes: Callable[[DictConfig], Shapes]) -> None:
    """Refuse (exit 2) a source whose tensors do not fit the configured model (`expected_shapes`:
    its registry entry's `shapes`), before launch."""
    m = cfg.model
    if not m.get("init_from"):
        return
    path = Path(str(m.init_from))
    found = file_shapes(path)
    fields = _llama_problems(m, path, found) if m.name in LLAMA_OPTIONS else []
    problems = mismatches(expected_shapes(cfg), found) or fields
    if problems:
        raise ConfigError(
            f"Invalid config: model.init_from={str(path)!r} does not fit model={m.name}: "
            f"{'; '.join(problems)}. Start from weights of the same architecture, or {_hint(m.name, path)}."
        )
