"""Checkpoint locations in a run dir, and the consolidated final weights."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

STEP_RE = re.compile(r"step-(\d+)")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def last_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (`last` points at it), or None for a fresh run."""
    last = checkpoint_dir(run_dir) / "last.ckpt"
    if last.is_symlink() or last.exists():
        target = last.resolve()
        return target if target.exists() else None
    return None


def step_of(path: Path) -> int | None:
    m = STEP_RE.search(path.name)
    return int(m.group(1)) if m else None


def save_final_weights(state: dict[str, torch.Tensor], run_dir: Path, metadata: dict[str, str]) -> Path:
    """Plain safetensors: loadable with `safetensors.torch.load_file`, no Loom needed."""
    out = run_dir / "final"
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    path = out / "model.safetensors"
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path
