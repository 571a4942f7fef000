"""`strategy=fsdp | fsdp_tp`: FSDP2 and tensor parallelism through Lightning's ModelParallelStrategy.

The LightningModule's `configure_model` calls back `strategy.parallelize(module)`, which applies
the model's tensor-parallel plan and FSDP2's `fully_shard` on the strategy's device mesh.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout


def _model_parallel_strategy_class():
    import torch
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

        def parallelize(self, module) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            s, hw, layout = self.loom_cfg.strategy, self.loom_cfg.hardware, self.loom_layout
            model = module.model
            mesh = self.device_mesh
            units = _unit_classes(module, s.get("shard_units"))
            if layout.tp > 1:
                _apply_tensor_parallel(module, mesh["tensor_parallel"])
            if layout.hybrid:
                dp_mesh = init_device_mesh(self.root_device.type, (layout.dp_replicate, layout.dp_shard),
                                           mesh_dim_names=("replicate", "shard"))
            else:
                dp_mesh = mesh["data_parallel"]
            param_dtype = {"bf16-mixed": torch.bfloat16}.get(hw.precision)
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
                else MixedPrecisionPolicy()
            kw = {"mesh": dp_mesh, "reshard_after_forward": bool(s.reshard_after_forward), "mp_policy": mp}
            for sub in list(model.modules()):
                if sub is not model and isinstance(sub, units):
                    fully_shard(sub, **kw)
            fully_shard(model, **kw)

        def full_model_state(self, trainer, module) -> dict:
            """Only rank 0 receives the tensors (on CPU), gathered from the DTensor shards."""
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    return LoomModelParallelStrategy


def _clip_grad_by_norm(optimizer, clip_val: float) -> None:
    """clip_grad_norm_ over DTensor gradients on any mix of meshes.

    The global norm is sqrt(sum over meshes of that mesh's squared norm); each mesh's norm is
    a DTensor reduction (`full_tensor()` all-reduces the partial sums over its dims), so
    replicated TP copies count once and shards add up, exactly like the unsharded model.
    """
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return
    by_mesh: dict[Any, list] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for gs in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(gs, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq += norm.float() ** 2
    # A Python float: torch's clip_grads_with_norm_ (_foreach_mul_ by a plain 0-d tensor)
    # left DTensor gradients unscaled here (torch 2.13).
    coef = float(clip_val) / (float(total_sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


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
    """The model's `tensor_parallel_plan` ({unit class: {submodule: colwise|rowwise}})."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
        data_parallel_size=layout.dp,
        tensor_parallel_size=layout.tp,
        save_distributed_checkpoint=True,
        process_group_backend=cfg.hardware.backend,
    )
