"""`loom export RUN_DIR --format hf|peft|loom [--out DIR] [--step N] [--dtype D]`: the weights of
a finished or checkpointed run, exported without training.

`select.py` decides (torch-free) which weights and where: a completed run's final weights, else
its newest checkpoint, or the checkpoint of `--step`; `<run>/export/<format>-step-<N>` unless
`--out` says otherwise (never final/ or checkpoints/). `sources.py` reads any strategy's
checkpoint with that format's own tool, one tensor at a time; `write.py` streams the tensors
through the writers training's final export uses: Loom's `model.safetensors`, or the Hugging
Face directory `checkpoint.export_format=hf` writes. A LoRA run (model.lora.r > 0) exports its
adapter (`--format peft`: the directory peft saves) or, with `--format hf`, the adapter merged
into its base by peft (`adapter.py`). Each export ends with `loom-export.json` (what it holds),
which `loom generate` reads to reuse it. torch is imported only once the request is valid.
"""

from __future__ import annotations

from loom.errors import EXIT_OK
from loom.export.select import FORMATS, Request, request

__all__ = ["FORMATS", "Request", "export", "request"]


def export(run: str, fmt: str | None, out: str | None = None, step: int | None = None,
           dtype: str | None = None) -> int:
    """The `loom export` verb: check the request, write the export, say where (ConfigError: exit 2)."""
    req = request(run, fmt, out, step, dtype)
    from loom.export.write import export as write

    paths = write(req)
    weights = sum(p.suffix == ".safetensors" for p in paths)
    print(f"exported {req.source.describe(req.run_dir)} of run {req.cfg.run.id} as --format {req.fmt} "
          f"({req.dtype}, {weights} weight file{'s' if weights != 1 else ''}, {len(paths)} files)")
    print(f"wrote {req.out}")
    return EXIT_OK
