"""One rehearsed rank, in a process of its own: `python -m loom.rehearse.rank CONFIG RANK OUT`.

The fake process group is process-global (one world, one rank per process), so every rank
the rehearsal looks at gets its own CPU process; it writes what it measured to OUT (JSON).

What runs is the worker's build path for that rank, stopped before the weights are drawn:
`dist.init_process_group("fake")` at the run's world size (collectives are no-ops), the
strategy's own device mesh (`strategies.mesh`: `mesh_of`, `pipeline_mesh`), the model
on the meta device, activation checkpointing, the strategy's `parallelize` (TP plan, pipeline
split, FSDP2 units) through `models.construct.parallelized`, `trainer.compile` off. Then,
under FakeTensorMode, the local shards are allocated (`to_empty`), the optimizer's states
are created for them, and one step of one micro batch at `dataset.seq_len` runs inside
torch's memory tracker (`step.py`).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom import models, strategies
from loom.layout import ParallelLayout


def device_type(cfg: DictConfig) -> tuple[str, str]:
    """The device the run would use, faked, and what to say about it. FSDP2 asks the CUDA
    runtime for its current device even over fake tensors, so without a CUDA build the GPU
    run is rehearsed with fake CPU tensors (the same shapes and dtypes, so the same bytes)."""
    import torch

    if cfg.hardware.accelerator != "gpu":
        return "cpu", "fake CPU tensors (a CPU run)"
    if torch.cuda.is_available():
        return "cuda", "fake CUDA tensors"
    return "cpu", "fake CPU tensors: this torch has no usable CUDA, so fake CUDA tensors fall back to CPU ones"


def fake_world(layout: ParallelLayout, rank: int) -> None:
    """This process as rank `rank` of the run's world over torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)


def strategy_for(cfg: DictConfig, layout: ParallelLayout, device: str) -> Any:
    """The run's Lightning strategy object with the mesh (and pipeline) its
    `setup_environment` would give it, built over the fake group."""
    import torch

    strategy = strategies.build_strategy(cfg, layout)
    strategy.parallel_devices = [torch.device(device)]  # what the Trainer's accelerator sets: root_device
    if not hasattr(strategy, "parallelize"):
        return None  # single, ddp: the whole model on every rank
    if layout.pp > 1:
        from loom.strategies.mesh import pipeline_mesh
        from loom.strategies.pipeline import Pipeline

        strategy._device_mesh = pipeline_mesh(device, layout)
        strategy.pipeline = Pipeline(cfg, layout, strategy._device_mesh, torch.device(device))
    else:
        from loom.strategies.mesh import mesh_of

        strategy._device_mesh = mesh_of(device, layout)
    return strategy


def build(cfg: DictConfig, layout: ParallelLayout, device: str) -> tuple[Any, Any, Any]:
    """(LightningModule, its parallelized network on meta, the strategy): the worker's path."""
    from loom.models.construct import parallelized

    module = models.build_module(cfg)
    if layout.pp > 1:
        module.automatic_optimization = False
    strategy = strategy_for(cfg, layout, device)
    model, _init, on_meta, how = parallelized(module, strategy)
    if not on_meta:
        raise ValueError(f"model={cfg.model.name} is not built on the meta device ({how}): "
                         "the rehearsal needs a meta build")
    return module, model, strategy


def rehearse_rank(cfg: DictConfig, rank: int) -> dict[str, Any]:
    """What rank `rank` holds and peaks at in one step (see the module docstring)."""
    from loom.rehearse.step import run_step

    start = time.time()
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.compile = False  # compile is off in a rehearsal (nothing runs for real)
    layout = strategies.layout_of(cfg)
    device, note = device_type(cfg)
    fake_world(layout, rank)
    module, model, strategy = build(cfg, layout, device)
    out = run_step(cfg, layout, module, model, strategy, device)
    out.update(rank=rank, device=device, device_note=note, seconds=round(time.time() - start, 2),
               mesh=str(getattr(strategy, "_device_mesh", None)))
    return out


def main(argv: list[str]) -> int:
    """CONFIG RANK OUT, repeated: each rank in turn, the fake group torn down between them
    (`loom plan --rehearse` starts one process per rank; tests batch theirs in one)."""
    import torch.distributed as dist

    for i in range(0, len(argv), 3):
        config, rank, out = Path(argv[i]), int(argv[i + 1]), Path(argv[i + 2])
        try:
            result = rehearse_rank(OmegaConf.load(config), rank)
        except Exception as e:  # the launch would fail the same way: its message, not a traceback
            result = {"rank": rank, "error": str(e) or repr(e), "error_type": type(e).__name__,
                      "traceback": traceback.format_exc(limit=-4)}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
