"""One training step of a rehearsed rank under FakeTensorMode, inside torch's memory tracker.

The local shards are allocated as fake tensors (`to_empty`), the optimizer's states are
created for them by one step on zero gradients (steady state: the states exist before the
step, as from the second step of a run on), then forward, backward and the optimizer step of
one micro batch run inside `FSDPMemTracker` (FSDP2) or `MemTracker` (anything else).

Bytes per rank: parameters and optimizer states are counted by the functions summary.json's
figures use (`strategies.base.param_bytes`, `optim_state_bytes`), gradients as the local
gradient tensors after backward; the activation peak is what the tracker files as
activations, temporaries and inputs at its peak; the total peak is the tracker's.

A pipeline rank runs its stage modules (`Pipeline.chunks`) the way its schedule would hold
them: as many chunk forwards as the schedule keeps in flight on that rank
(`plan.pipeline.in_flight`, e.g. 1F1B's p - r), then their backwards; a stage that is not
the first gets a hidden state of the stage boundary's shape as input.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.data.batch import Batch
from loom.layout import ParallelLayout
from loom.models import model_width, vocab_size
from loom.strategies import lightning_precision
from loom.strategies.base import optim_state_bytes, param_bytes, tensor_bytes

# Lightning's precision plugin for the Trainer's `precision` (strategies.lightning_precision):
# its convert_module and forward_context are what the Trainer applies around a step.
_PLUGINS = {
    "bf16-mixed": lambda device: _plugins().MixedPrecision("bf16-mixed", device),
    "16-mixed": lambda device: _plugins().MixedPrecision("16-mixed", device),
    "bf16-true": lambda device: _plugins().HalfPrecision("bf16-true"),
    "16-true": lambda device: _plugins().HalfPrecision("16-true"),
}


def _plugins():
    from pytorch_lightning.plugins import precision

    return precision


def precision_plugin(cfg: DictConfig, device: str) -> Any:
    make = _PLUGINS.get(lightning_precision(cfg))
    return make(device) if make else _plugins().Precision()


def _optimizer(module: Any) -> Any:
    conf = module.configure_optimizers()
    return conf["optimizer"] if isinstance(conf, dict) else conf


def _warm_states(model: Any, optim: Any) -> None:
    """The optimizer's states for the local shards: one step on zero gradients."""
    import torch

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)


def _tracker(model: Any, optim: Any, fsdp: bool) -> tuple[Any, str]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if fsdp and isinstance(model, FSDPModule):
        return FSDPMemTracker(model, optim), "FSDPMemTracker"
    tracker = MemTracker()
    tracker.track_external(model, optim)
    return tracker, "MemTracker"


def _pipeline_roots(strategy: Any) -> list:
    pipe = getattr(strategy, "pipeline", None)
    return list(pipe.chunks) if pipe is not None else []


def run_step(cfg: DictConfig, layout: ParallelLayout, module: Any, model: Any, strategy: Any,
             device: str) -> dict[str, Any]:
    """Allocate, create the optimizer's states, step once under the tracker; the bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    plugin = precision_plugin(cfg, device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)
        model = plugin.convert_module(model)
        module.model = model
        optim = _optimizer(module)
        _warm_states(model, optim)
        chunks = _pipeline_roots(strategy)
        # FSDPMemTracker refuses a module called several times in one step (microbatches in flight)
        tracker, tracker_name = _tracker(model, optim, fsdp=not chunks)
        with tracker:
            if chunks:
                grads, extra = _pipeline_step(cfg, layout, module, strategy, plugin, device)
            else:
                grads, extra = _plain_step(cfg, module, plugin, device)
            optim.step()
            optim.zero_grad(set_to_none=True)
        peak = _peak(tracker)
    params, states = param_bytes(model), optim_state_bytes(optim)
    acts = sum(v for k, v in peak.items() if k in ("Activation", "Temp", "Inputs", "Input"))
    return {"tracker": tracker_name, "bytes": {"params": params, "grads": grads, "optimizer": states,
                                               "activations": acts, "peak": peak.get("Total", 0)},
            "tracker_peak": peak, "dtype": str(next(iter(model.parameters())).dtype).replace("torch.", ""),
            **extra}


def _peak(tracker: Any) -> dict[str, int]:
    """The tracker's peak snapshot summed over devices, by its own category names."""
    out: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot("peak").values():
        for k, v in snap.items():
            name = getattr(k, "value", str(k))
            out[name] = out.get(name, 0) + int(v)
    return out


def _grad_bytes(params) -> int:
    return sum(tensor_bytes(p.grad) for p in params if p.grad is not None)


def _batch(cfg: DictConfig, micro: int, device: str):
    import torch

    s, vocab = int(cfg.dataset.seq_len), vocab_size(cfg)
    x = torch.randint(0, vocab, (micro, s), device=device)
    return x, torch.randint(0, vocab, (micro, s), device=device)


def _plain_step(cfg: DictConfig, module: Any, plugin: Any, device: str) -> tuple[int, dict]:
    """Forward, loss and backward of one micro batch (`dataset.batch_size` samples)."""
    x, y = _batch(cfg, int(cfg.dataset.batch_size), device)
    with plugin.forward_context():
        loss = module._loss(Batch(x, y))
    loss.backward()
    return _grad_bytes(module.model.parameters()), {"micro_batch": int(cfg.dataset.batch_size)}


def _microbatch(chunk: Any) -> Any:
    """A fresh module around `chunk` for one microbatch: torch's MemTracker refuses a top-level
    module called twice in one step (its per-module statistics), not a child called twice."""
    from torch import nn

    class Microbatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chunk = chunk

        def forward(self, x):
            return self.chunk(x)

    return Microbatch()


def _pipeline_step(cfg: DictConfig, layout: ParallelLayout, module: Any, strategy: Any, plugin: Any,
                   device: str) -> tuple[int, dict]:
    """The rank's stage chunks, `in_flight` forwards then their backwards (module docstring)."""
    import torch

    from loom.plan.pipeline import in_flight

    pipe = strategy.pipeline
    micro = max(1, int(cfg.dataset.batch_size) // pipe.microbatches)
    flight = in_flight(pipe.name, pipe.pp, pipe.microbatches, pipe.per_rank, pipe.pp_rank)
    outs = []
    # one precision context around the schedule's whole step, as Lightning's around training_step
    # (autocast casts each weight once per context: the bf16 copies are shared by the microbatches)
    with plugin.forward_context():
        for i in range(flight):
            chunk = pipe.chunks[i % len(pipe.chunks)]
            x, y = _batch(cfg, micro, device)
            if not chunk.is_first:
                x = torch.randn(micro, int(cfg.dataset.seq_len), model_width(cfg), device=device,
                                requires_grad=True)
            out = _microbatch(chunk)(x)
            outs.append(module._lm_loss(out, y) if chunk.is_last else out)
        for out in outs:
            out.backward() if out.dim() == 0 else out.backward(torch.ones_like(out))
    extra = {"micro_batch": micro, "pp_rank": pipe.pp_rank, "stages": list(pipe.stages),
             "blocks": pipe.local_blocks(), "in_flight": flight}
    return _grad_bytes(module.model.parameters()), extra
