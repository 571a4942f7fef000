"""`strategy=fsdp | fsdp_tp`: FSDP2 and tensor parallelism through Lightning's ModelParallelStrategy.

The LightningModule's `configure_model` calls back `strategy.parallelize(module)`, which applies
the model's tensor-parallel plan and FSDP2's `fully_shard` on the strategy's device mesh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.strategies.expert_parallel import shard_experts
from loom.strategies.mesh import mesh_of

log = logging.getLogger("loom")


def _model_parallel_strategy_class():
    from pytorch_lightning.strategies import ModelParallelStrategy

    from loom.strategies.base import LoomStrategy

    class LoomModelParallelStrategy(LoomStrategy, ModelParallelStrategy):
        """ModelParallelStrategy that knows how to parallelize Loom's models.

        Lightning builds the (data_parallel, tensor_parallel) mesh with
        `init_device_mesh(root_device.type, ...)`, which is "cpu" for CPU processes, so its
        mesh works on gloo as is. The LightningModule's `configure_model` calls
        `parallelize(module)`: the model's TP plan on the tensor-parallel dim, then
        `fully_shard` on each sharding unit and the root across the data-parallel dim
        (or a (replicate, shard) 2-D mesh, HSDP, across nodes).
        """

        def __init__(self, cfg: DictConfig, layout: ParallelLayout, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.loom_cfg = cfg
            self.loom_layout = layout

        def setup(self, trainer) -> None:
            super().setup(trainer)
            # Lightning clips with torch.nn.utils.clip_grad_norm_, which stacks the per-tensor
            # norms and so fails when gradients live on different meshes (fsdp_tp: TP-split
            # weights on the 2-D mesh, embeddings and norms on the data-parallel dim only).
            self.precision_plugin.clip_grad_by_norm = _clip_grad_by_norm

        def setup_environment(self) -> None:
            """Lightning's (data_parallel, tensor_parallel) mesh; under HSDP a (replicate, shard,
            tensor_parallel) one instead, its first two dims flattened as data_parallel, so FSDP2's
            (replicate, shard) mesh and the TP mesh share a root (FSDP2 x TP needs that)."""
            super().setup_environment()
            lay = self.loom_layout
            if lay.hybrid or lay.ep > 1 or lay.cp > 1:
                mesh = mesh_of(self.root_device.type, lay)
                self._device_mesh = self.lightning_module._device_mesh = mesh

        def parallelize(self, module) -> None:
            s, hw, layout = self.loom_cfg.strategy, self.loom_cfg.hardware, self.loom_layout
            model = module.model
            mesh = self.device_mesh
            units = _unit_classes(module, s.get("shard_units"))
            if layout.tp > 1:
                _apply_tensor_parallel(module, mesh["tensor_parallel"])
            if layout.cp > 1:
                module.context_parallel(mesh["cp"], str(layout.cp_style))
            dp_mesh = mesh["replicate", "shard"] if layout.hybrid else mesh["data_parallel"]
            mp, how = _precision_policy(hw.precision)
            log.info(f"precision {hw.precision}: {how}")
            _log_compute_dtype_once(model, units)
            if layout.ep > 1:
                shard_experts(module, mesh, layout, bool(s.reshard_after_forward), mp)
            shard_roots([model], units, dp_mesh, bool(s.reshard_after_forward), mp)

        _loom_pending: Any = None      # the future of the checkpoint being written (checkpoint.async)
        _loom_ckpt_group: Any = None   # the gloo group the background writer coordinates over

        @property
        def async_checkpoints(self) -> bool:
            return bool(self.loom_cfg.checkpoint.get("async", False))

        def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
            """Lightning's distributed save, or under `checkpoint.async` the same files written in
            the background (`_async_save`)."""
            if not self.async_checkpoints or storage_options is not None:
                super().save_checkpoint(checkpoint, filepath, storage_options)
            else:
                _async_save(self, checkpoint, filepath)

        def lightning_module_state_dict(self) -> dict:
            """Under checkpoint.async the shards stay on their device: async_save's staging makes
            the one host copy (Lightning's cpu_offload=True would add a second one on GPUs)."""
            if not self.async_checkpoints:
                return super().lightning_module_state_dict()
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            from loom.models.lora import adapter_state

            return adapter_state(self.lightning_module, get_model_state_dict(self.model))

        def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
            """Lightning's, or a LoRA checkpoint's adapter alone (`_load_adapter`)."""
            from loom.models.lora import adapter_only

            if not adapter_only(self.lightning_module):
                return super().load_checkpoint(checkpoint_path, weights_only)
            return _load_adapter(self, Path(self.broadcast(checkpoint_path)), weights_only)

        def optimizer_state(self, optimizer) -> dict:
            """As `lightning_module_state_dict`: sharded, not offloaded, under checkpoint.async."""
            if not self.async_checkpoints:
                return super().optimizer_state(optimizer)
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

        def wait_for_checkpoint(self) -> None:
            """Raises what the background write raised: a failed checkpoint fails the run."""
            future, self._loom_pending = self._loom_pending, None
            if future is not None:
                future.result()

    return LoomModelParallelStrategy


def _load_adapter(strategy, path: Path, weights_only: bool | None) -> dict:
    """Lightning's sharded load (`_load_checkpoint`) for a checkpoint without the frozen base: it asks
    DCP for every parameter of the model, which fails on the base's. Here only the trainable ones
    are asked for, after checking the checkpoint holds exactly those (strict for the adapter); the
    base keeps what the build gave it (model.init_from, read again). Returns the non-tensor state."""
    import torch
    from lightning_fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from loom.models.lora import check_keys

    model = strategy.model
    state = {"state_dict": get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))}
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    check_keys([k.removeprefix("state_dict.") for k in saved if k.startswith("state_dict.")], state["state_dict"],
               f"checkpoint {path.name}")
    load(state, checkpoint_id=path)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=False))
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _precision_policy(precision: str) -> tuple[Any, str]:
    """FSDP2's MixedPrecisionPolicy for `hardware.precision`, and a line saying who casts what.

    FSDP2 is the only mechanism: Lightning gets "32-true" for bf16-mixed
    (`strategies.lightning_precision`), so no autocast runs on top of the policy. Under
    bf16-true Lightning's HalfPrecision casts the parameters themselves (optimizer states
    follow), and FSDP2 still reduces the gradients in fp32. (16-mixed is refused in validation.)
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "FSDP2 MixedPrecisionPolicy(param=bf16, reduce=fp32), fp32 sharded params and "
                "optimizer states, no autocast")
    if precision == "bf16-true":
        return (MixedPrecisionPolicy(reduce_dtype=torch.float32),
                "parameters and optimizer states in bf16 (Lightning HalfPrecision), "
                "FSDP2 MixedPrecisionPolicy(reduce=fp32), no autocast")
    return MixedPrecisionPolicy(), "fp32 throughout, no autocast"


def _log_compute_dtype_once(model, units: tuple[type, ...]) -> None:
    """Log, at the first forward, the dtype the first Linear of the first sharding unit computes
    in and whether autocast is on: the rank log then shows the precision actually in force
    (under fsdp_tp that Linear is tensor-parallel, so TP-sharded modules are covered too)."""
    import torch

    unit = next((m for m in model.modules() if m is not model and isinstance(m, units)), model)
    linear = next((m for m in unit.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        return

    def hook(mod, args) -> None:
        x = args[0] if args else None
        autocast = torch.is_autocast_enabled(x.device.type) if x is not None else None
        log.info(f"first forward: {type(mod).__name__} weight {mod.weight.dtype}, "
                 f"input {getattr(x, 'dtype', None)}, autocast {'on' if autocast else 'off'}")
        handle.remove()

    handle = linear.register_forward_pre_hook(hook)


def _async_save(strategy, checkpoint: dict, filepath) -> None:
    """ModelParallelStrategy.save_checkpoint's files, written by DCP's `async_save`.

    Same layout as Lightning's distributed save, so resuming loads through Lightning as before:
    a DCP directory ("state_dict", "optimizer_0", ... sharded, `.metadata` written last) plus
    rank 0's `meta.pt` with the rest of the checkpoint. `async_save` copies this rank's shards
    to host memory before it returns (training may then change the parameters) and writes them
    from a thread; that thread's collectives (plan exchange, `.metadata`) run over a gloo group
    of their own, created once, so they never interleave with training's collectives on the
    default group (and gloo gives the CPU backend async_save requires under NCCL too). At most
    one save is in flight: the previous one is awaited first.
    """
    import os

    import torch
    import torch.distributed as dist
    from lightning_fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint import async_save

    strategy.wait_for_checkpoint()
    path = Path(strategy.broadcast(str(filepath)))
    path.mkdir(parents=True, exist_ok=True)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    if strategy._loom_ckpt_group is None:
        strategy._loom_ckpt_group = dist.new_group(backend="gloo")
    strategy._loom_pending = async_save(state, checkpoint_id=path, process_group=strategy._loom_ckpt_group)
    if strategy.global_rank == 0:
        with open(path / _METADATA_FILENAME, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


def _clip_grad_by_norm(optimizer, clip_val: float) -> None:
    """clip_grad_norm_ over DTensor gradients on any mix of meshes, with no host sync.

    The global norm is sqrt(sum over meshes of that mesh's squared norm); each mesh's norm is
    a DTensor reduction (`full_tensor()` all-reduces the partial sums over its dims), so
    replicated TP copies count once and shards add up, exactly like the unsharded model. The
    total and the clamped coefficient stay device tensors (torchtitan's way), and the
    coefficient multiplies each rank's *local* gradient tensors with foreach ops: torch's
    `clip_grads_with_norm_` (`_foreach_mul_` on the DTensors by a 0-d tensor) left DTensor
    gradients unscaled here (torch 2.13), and it reads `p.grad`, not gradient lists.
    """
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return
    total = squared_norm(grads).sqrt()
    scale_grads(grads, torch.clamp(float(clip_val) / (total + 1e-6), max=1.0))


def squared_norm(grads: list):
    """The squared 2-norm of gradients on any mix of meshes (and plain tensors), a 0-d fp32
    device tensor: per mesh a DTensor reduction whose `full_tensor()` reduces over its dims."""
    import torch
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total = None
    for gs in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(gs, norm_type=2.0)  # foreach where the device has it
        sq = (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
        total = sq if total is None else total + sq.to(total.device)
    return total


def scale_grads(grads: list, coef) -> None:
    """Multiply each rank's local gradient tensors by `coef` (views: the DTensors follow)."""
    import torch
    from torch.distributed.tensor import DTensor

    by_kind: dict[tuple, list] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(device))


def shard_roots(roots: list, units: tuple[type, ...], dp_mesh, reshard_after_forward: bool,
                mp_policy: Any = None) -> None:
    """FSDP2 over the data-parallel mesh: every sharding unit inside each root, then the root
    itself (the whole model, or one pipeline stage: `strategies.pipeline`). The one place
    fsdp, fsdp_tp, pp and nd apply `fully_shard`."""
    from torch.distributed.fsdp import fully_shard

    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    sharded = []
    for root in roots:
        for sub in list(root.modules()):
            if sub is not root and isinstance(sub, units):
                fully_shard(sub, **kw)
                sharded.append(sub)
        fully_shard(root, **kw)
    log.info(f"fsdp: {len(sharded)} unit(s) sharded, {_resharding(sharded)} after forward")


def _resharding(sharded: list) -> str:
    """What FSDP2 itself will do with the units' gathered parameters after their forward (read
    back from its parameter groups, so the log says what runs, not what was asked)."""
    try:  # FSDP2's private state: a log line must not fail a run on a torch that renamed it
        groups = [m._get_fsdp_state()._fsdp_param_group for m in sharded]
        keeps = sum(g is not None and g.post_forward_mesh_info is None for g in groups)
    except AttributeError:
        return "resharding unknown (this torch's FSDP2 state differs)"
    return f"{keeps} keep their parameters gathered, {len(groups) - keeps} reshard them"


def _unit_classes(module, names) -> tuple[type, ...]:
    """The module classes sharded as units: `strategy.shard_units` by name, else the model's."""
    if not names:
        return tuple(module.sharding_units)
    by_name = {type(m).__name__: type(m) for m in module.model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"strategy.shard_units: {missing} are not module classes of this model; "
                         f"it has {sorted(by_name)}")
    return tuple(by_name[n] for n in names)


def _apply_tensor_parallel(module, tp_mesh) -> None:
    """The module's own `apply_tensor_parallel` where it has one (a transformers decoder's plan),
    else its `tensor_parallel_plan` ({unit class: {submodule: colwise|rowwise}})."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    own = getattr(module, "apply_tensor_parallel", None)
    if own is not None:
        own(tp_mesh)
        return
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = getattr(module, "tensor_parallel_plan", None)
    if not plan:
        raise ValueError(f"{type(module).__name__} has no tensor_parallel_plan: use strategy=fsdp")
    for unit_cls, unit_plan in plan.items():
        for sub in module.model.modules():
            if isinstance(sub, unit_cls):
                parallelize_module(sub, tp_mesh, {k: styles[v]() for k, v in unit_plan.items()})


def build(cfg: DictConfig, layout: ParallelLayout):
    return _model_parallel_strategy_class()(
        cfg,
        layout,
        data_parallel_size=layout.dp * layout.cp,  # Lightning's data_parallel dim: every rank holding other tokens
        tensor_parallel_size=layout.tp,
        save_distributed_checkpoint=True,
        process_group_backend=cfg.hardware.backend,
    )
