"""The export itself: the run's network entries, in the order and under the names of its final
weights, read from the source one tensor at a time, cast and streamed into Loom's
`model.safetensors` or the Hugging Face directory, through the writers training's final export
uses (rundir.checkpoints.write_weights_file, rundir.hf_export.write_hf_dir). A LoRA run's
adapter is written, or merged, by loom.export.adapter. The directory's MARKER comes last.

The entries come from the run's own network built on the meta device (no parameter storage):
the same keys, order, shapes and dtypes as `module.model.state_dict()`, which is what the
worker exports, so an export of the final step's checkpoint equals final/ tensor for tensor. A
checkpoint's names carry the LightningModule's `model.` prefix and, where a wrapper held the
parameters when it was saved (ZeRO-3 under activation checkpointing, a compiled module), the
wrapper's segment (sources.unwrapped). A tensor the source lacks or holds in another shape stops
the export (exit 2) before a file is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig

from loom.atomic import atomic_path
from loom.errors import ConfigError
from loom.export.select import MARKER, Request, lora_rank
from loom.export.sources import WeightsSource, open_source, unwrapped
from loom.rundir.safetensors_stream import EXPORT_DTYPES, Spec, dtype_name

Entry = tuple[str, tuple[int, ...], torch.dtype]


def network_entries(cfg: DictConfig) -> list[Entry] | None:
    """(name, shape, dtype) of each entry of the run's network, in its state_dict's order, from a
    build on the meta device; None for a user's own LightningModule (its state as it saved it)."""
    from loom.models import build_module
    from loom.models.init import params_on_meta

    build = getattr(build_module(cfg), "build_model", None)
    if build is None:
        return None
    with params_on_meta():
        net = build()
    return [(k, tuple(t.shape), t.dtype) for k, t in net.state_dict(keep_vars=True).items()]


def plan_tensors(entries: list[Entry] | None, source: WeightsSource, dtype: torch.dtype, where: str
                 ) -> tuple[list[Spec], Iterator[tuple[str, torch.Tensor]]]:
    """(specs, tensors): what will be written, announced before any tensor is read (each entry
    checked against the source's shapes), and the generator that reads and casts each in turn."""
    have = source.entries()
    prefix = source.prefix if entries is not None else ""
    if entries is None:
        entries = [(unwrapped(k), shape, dt) for k, (shape, dt) in have.items()]
    raw = {unwrapped(n): n for n in have}  # the network's name -> the source's (wrappers' segments in it)
    for key, shape, _ in entries:
        name = raw.get(prefix + key)
        if name is None:
            raise ConfigError(f"Invalid usage: loom export: {where} holds no tensor {prefix + key!r} of the run's "
                              f"model ({len(have)} tensors in it): it is not this run's weights.")
        if tuple(have[name][0]) != tuple(shape):
            raise ConfigError(f"Invalid usage: loom export: {where} holds {name!r} with shape {list(have[name][0])}; "
                              f"the run's model has {list(shape)}: it is not this run's weights.")
    specs = [(k, shape, dtype_name(dtype if dt.is_floating_point else dt)) for k, shape, dt in entries]

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for key, _, dt in entries:
            t = source.get(raw[prefix + key])
            yield key, t.to(dtype) if dt.is_floating_point else t.to(dt)

    return specs, read()


def export(req: Request) -> list[Path]:
    """Write `req`'s export into `req.out`, MARKER last (what it holds: `Request.done`); the files
    written. A LoRA run's adapter goes through peft (loom.export.adapter)."""
    dtype = getattr(torch, EXPORT_DTYPES[req.dtype])
    (req.out / MARKER).unlink(missing_ok=True)  # until this export is whole, the dir holds no export
    if lora_rank(req.cfg):
        from loom.export.adapter import write_adapter, write_merged

        paths = write_adapter(req, req.out, dtype) if req.fmt == "peft" else write_merged(req, dtype)
    else:
        paths = _write_whole(req, dtype)
    with atomic_path(req.out / MARKER) as tmp:
        tmp.write_text(json.dumps(req.marker(), indent=2) + "\n")
    return paths


def _write_whole(req: Request, dtype: torch.dtype) -> list[Path]:
    """A run's whole network: Loom's model.safetensors or a Hugging Face directory."""
    from loom.rundir.checkpoints import write_weights_file

    where = req.source.describe(req.run_dir)
    entries = network_entries(req.cfg)
    source = open_source(req.source.path)
    try:
        specs, stream = plan_tensors(entries, source, dtype, where)
        meta = {"run_id": str(req.cfg.run.id), "model": str(req.cfg.model.name), "step": str(req.source.step),
                "dtype": req.dtype, "source": str(req.source.path.relative_to(req.run_dir))}
        req.out.mkdir(parents=True, exist_ok=True)
        if req.fmt == "loom":
            return [write_weights_file(req.out, specs, stream, meta)]
        from loom.models import hf_export_config
        from loom.rundir.hf_export import write_hf_dir

        config = {**hf_export_config(req.cfg), "torch_dtype": dtype_name(dtype)}
        return write_hf_dir(req.out, config, specs, stream, meta, float(req.cfg.checkpoint.export_shard_gb) * 1e9,
                            req.cfg.dataset.get("tokenizer"))
    finally:
        source.close()
