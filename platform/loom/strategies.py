"""Build the Lightning strategy named by `cfg.strategy` for the resolved hardware.

single / ddp: Lightning's DDPStrategy (comm hooks registered on CPU too).
fsdp / fsdp_tp: Lightning's ModelParallelStrategy; the LightningModule's `configure_model`
  calls back `strategy.parallelize(module)`, which applies the tensor-parallel plan and
  FSDP2's `fully_shard` on the strategy's device mesh.
zero1 | zero2 | zero3 | zero3_offload: DeepSpeed ZeRO (Lightning's DeepSpeedStrategy on
  CUDA, loom.deepspeed_cpu's subclass on CPU processes).

Importing this module imports no torch: `resolved_deepspeed_config` runs during validation.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

MODEL_PARALLEL = ("fsdp", "fsdp_tp")
ZERO = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3}


# ----------------------------------------------------------------------------- ddp


def ddp_comm_hook(name: str | None, powersgd_rank: int) -> dict[str, Any]:
    """DDPStrategy kwargs for a gradient-compression hook from torch's default hooks."""
    if name is None:
        return {}
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16_compress":
        return {"ddp_comm_hook": default_hooks.fp16_compress_hook}
    if name == "bf16_compress":
        return {"ddp_comm_hook": default_hooks.bf16_compress_hook}
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=2
        )
        return {"ddp_comm_state": state, "ddp_comm_hook": powerSGD_hook.powerSGD_hook}
    raise ValueError(f"unknown comm hook {name}")


def _ddp_strategy_class():
    from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
    from pytorch_lightning.strategies import DDPStrategy

    class LoomDDPStrategy(DDPStrategy):
        """DDPStrategy that registers the gradient comm hook on CPU (gloo) as well.

        Lightning's `_register_ddp_hooks` only registers hooks when the root device is CUDA
        (a note from torch 1.8, when hooks needed NCCL); torch's default hooks work over
        gloo today, so without this a CPU run would silently train uncompressed.
        """

        comm_hook_registered = False

        def _register_ddp_hooks(self) -> None:
            if self.root_device.type == "cuda":
                super()._register_ddp_hooks()
            elif self._ddp_comm_hook is not None:
                _register_ddp_comm_hook(
                    model=self.model,
                    ddp_comm_state=self._ddp_comm_state,
                    ddp_comm_hook=self._ddp_comm_hook,
                    ddp_comm_wrapper=self._ddp_comm_wrapper,
                )
            self.comm_hook_registered = self._ddp_comm_hook is not None
            if self.comm_hook_registered:
                import logging

                logging.getLogger("loom").info(
                    f"ddp comm hook {self._ddp_comm_hook.__name__} registered on {self.root_device.type}")

    return LoomDDPStrategy


# ----------------------------------------------------------------------------- fsdp / tp


def _model_parallel_strategy_class():
    import torch
    from pytorch_lightning.strategies import ModelParallelStrategy

    class LoomModelParallelStrategy(ModelParallelStrategy):
        """ModelParallelStrategy that knows how to parallelize Loom's models.

        Lightning builds the (data_parallel, tensor_parallel) mesh with
        `init_device_mesh(root_device.type, ...)`, which is "cpu" for CPU processes, so its
        mesh works on gloo as is. The LightningModule's `configure_model` calls
        `parallelize(module)`: the model's TP plan on the tensor-parallel dim, then
        `fully_shard` on each sharding unit and the root across the data-parallel dim
        (or a (replicate, shard) 2-D mesh, HSDP, across nodes).
        """

        def __init__(self, cfg: DictConfig, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.loom_cfg = cfg

        def setup(self, trainer) -> None:
            super().setup(trainer)
            # Lightning clips with torch.nn.utils.clip_grad_norm_, which stacks the per-tensor
            # norms and so fails when gradients live on different meshes (fsdp_tp: TP-split
            # weights on the 2-D mesh, embeddings and norms on the data-parallel dim only).
            self.precision_plugin.clip_grad_by_norm = _clip_grad_by_norm

        def parallelize(self, module) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            s, hw = self.loom_cfg.strategy, self.loom_cfg.hardware
            model = module.model
            mesh = self.device_mesh
            tp = int(s.get("tensor_parallel", 1) or 1)
            units = _unit_classes(module, s.get("shard_units"))
            if tp > 1:
                _apply_tensor_parallel(module, mesh["tensor_parallel"])
            if tp == 1 and hw.num_nodes > 1 and s.get("hybrid_shard", True):
                dp_mesh = init_device_mesh(self.root_device.type, (hw.num_nodes, hw.devices),
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


# ----------------------------------------------------------------------------- deepspeed


def _deepspeed_json(path: str) -> dict:
    from loom.config import ConfigError

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r}: no such file "
            f"(resolved to {p.resolve()}). Pass the path to a DeepSpeed JSON config, or null for Loom's."
        )
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r} is not valid JSON ({e}). "
            "Fix the file or pass null for Loom's DeepSpeed config."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"Invalid config: strategy.deepspeed_config={path!r} must hold a JSON object "
            f"(got {type(data).__name__})."
        )
    return data


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[leaf] = value


_MISSING = object()


def resolved_deepspeed_config(cfg: DictConfig) -> dict:
    """The DeepSpeed config this run uses: Loom's values merged over the user's JSON.

    Loom sets the batch, accumulation, ZeRO stage, precision, clipping and offload keys from
    the run config; a user JSON (`strategy.deepspeed_config`) may add anything else, but a key
    Loom sets with a different value is a ConfigError naming both values and their sources.
    No torch import: this runs during validation (exit 2) and is written to plan.json.
    """
    from loom.config import ConfigError

    s, hw, tr = cfg.strategy, cfg.hardware, cfg.trainer
    stage = ZERO[s.name]
    prec = hw.precision
    clip = float(tr.gradient_clip_val or 0.0)
    ours: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (cfg.dataset.batch_size, f"dataset.batch_size={cfg.dataset.batch_size}"),
        "gradient_accumulation_steps": (tr.accumulate_grad_batches,
                                        f"trainer.accumulate_grad_batches={tr.accumulate_grad_batches}"),
        "zero_optimization.stage": (stage, f"strategy={s.name}"),
        "bf16.enabled": (prec in ("bf16-mixed", "bf16-true"), f"hardware.precision={prec}"),
        "fp16.enabled": (prec in ("16-mixed", "16-true"), f"hardware.precision={prec}"),
        "gradient_clipping": (clip, f"trainer.gradient_clip_val={tr.gradient_clip_val}"),
    }
    if s.offload_optimizer:
        ours["zero_optimization.offload_optimizer.device"] = ("cpu", "strategy.offload_optimizer=true")
        # The run's own torch AdamW steps on the host (see conf/strategy/zero3_offload.yaml).
        ours["zero_force_ds_cpu_optimizer"] = (False, "strategy.offload_optimizer=true (torch AdamW)")
    if s.offload_params:
        ours["zero_optimization.offload_param.device"] = ("cpu", "strategy.offload_params=true")
    defaults: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,  # torch's AdamW, from optim/; ZeRO handles it
        "steps_per_print": 10**9,              # Loom logs; keep DeepSpeed's console quiet
        "wall_clock_breakdown": False,
    }
    if s.offload_optimizer:
        defaults["zero_optimization.offload_optimizer.pin_memory"] = hw.accelerator == "gpu"
    user: dict = {}
    if s.deepspeed_config:
        user = _deepspeed_json(s.deepspeed_config)
    out = copy.deepcopy(user)
    for key, (value, source) in ours.items():
        theirs = _get(user, key)
        if theirs is not _MISSING and not _same(theirs, value):
            raise ConfigError(
                f"Invalid config: strategy.deepspeed_config={s.deepspeed_config!r} sets {key}={theirs!r}, "
                f"but Loom sets {key}={value!r} from {source}. Remove {key} from the JSON "
                f"(Loom fills it in) or change {source.split(' ')[0].split('=')[0]} to match."
            )
        _set(out, key, value)
    for key, value in defaults.items():
        if _get(out, key) is _MISSING:
            _set(out, key, value)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _deepspeed_strategy(cfg: DictConfig):
    hw = cfg.hardware
    ds_config = resolved_deepspeed_config(cfg)
    # Lightning fills this in from Trainer(accumulate_grad_batches) and refuses it in the dict.
    ds_config.pop("gradient_accumulation_steps", None)
    if hw.accelerator == "cpu":
        from loom.deepspeed_cpu import CPUDeepSpeedStrategy, use_cpu_accelerator

        use_cpu_accelerator()
        return CPUDeepSpeedStrategy(config=ds_config, process_group_backend="gloo")
    from pytorch_lightning.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(config=ds_config, process_group_backend=hw.backend)


# ----------------------------------------------------------------------------- build


def build_strategy(cfg: DictConfig):
    s, hw = cfg.strategy, cfg.hardware
    if s.name == "single":
        return "auto"
    if s.name == "ddp":
        return _ddp_strategy_class()(
            process_group_backend=hw.backend,
            find_unused_parameters=s.find_unused_parameters,
            bucket_cap_mb=s.bucket_cap_mb,
            **ddp_comm_hook(s.comm_hook, s.powersgd_rank),
        )
    if s.name in MODEL_PARALLEL:
        world = hw.devices * hw.num_nodes
        tp = int(s.get("tensor_parallel", 1) or 1)
        return _model_parallel_strategy_class()(
            cfg,
            data_parallel_size=world // tp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=True,
            process_group_backend=hw.backend,
        )
    if s.name in ZERO:
        return _deepspeed_strategy(cfg)
    raise ValueError(f"unknown strategy {s.name}")


def data_parallel(cfg: DictConfig, global_rank: int, world_size: int) -> tuple[int, int]:
    """(rank, size) along the data-parallel dimension: the sampler shards by these.

    Lightning's ModelParallelStrategy lays ranks out as a (data_parallel, tensor_parallel)
    mesh in row-major order, so the TP peers of a group are consecutive ranks and share the
    data-parallel rank `global_rank // tp`: they see the same batch.
    """
    tp = int(cfg.strategy.get("tensor_parallel", 1) or 1) if cfg.strategy.name == "fsdp_tp" else 1
    return global_rank // tp, world_size // tp


# ----------------------------------------------------------------------------- results


def _is_deepspeed(strategy) -> bool:
    from pytorch_lightning.strategies import DeepSpeedStrategy

    return isinstance(strategy, DeepSpeedStrategy)


def _is_model_parallel(strategy) -> bool:
    from pytorch_lightning.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def full_model_state(trainer, module) -> dict:
    """The consolidated (unsharded) model state dict; a collective, call it on every rank.

    Keys are those of the plain model's `module.model.state_dict()`. Under FSDP2/TP only
    rank 0 receives the tensors (on CPU); ZeRO-3 gathers each partitioned parameter in turn.
    """
    strategy = trainer.strategy
    if _is_model_parallel(strategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _is_deepspeed(strategy) and strategy.zero_stage_3:
        import deepspeed

        out: dict = {}
        names = dict(module.model.named_parameters())
        for key, value in module.model.state_dict(keep_vars=True).items():
            if key in names:
                with deepspeed.zero.GatheredParameters([names[key]], modifier_rank=None):
                    if trainer.global_rank == 0:
                        out[key] = names[key].detach().to("cpu").clone()
            elif trainer.global_rank == 0:
                out[key] = value.detach().to("cpu").clone()
        return out
    # A user's own LightningModule (model=custom) may hold no `.model`: its own state then.
    return getattr(module, "model", module).state_dict()


def local_state_bytes(trainer, module) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) this rank holds, counted from its tensors.

    - DDP/single: the whole model; the optimizer's state tensors (Adam m, v).
    - FSDP2/TP: parameters and states are DTensors; their local shards are counted.
    - ZeRO-1/2: parameters are whole on every rank. Optimizer state = this rank's fp32
      master partition (`single_partition_of_fp32_groups`, kept even in fp32 runs) plus the
      inner optimizer's m and v for that partition (the ZeRO paper's 12 bytes/param / N).
    - ZeRO-3: parameters = each parameter's local partition (`p.ds_tensor`); optimizer state
      = the fp32 master partitions (`fp32_partitioned_groups_flat`) plus m and v. With
      offload these live in host memory but are still this rank's.
    Tensors sharing storage are counted once.
    """
    from loom.memory import optim_state_bytes, param_bytes, tensor_bytes

    strategy = trainer.strategy
    if not _is_deepspeed(strategy):
        return param_bytes(module), sum(optim_state_bytes(o) for o in trainer.optimizers)
    seen: set[int] = set()

    def count(t) -> int:
        if t is None or t.numel() == 0:
            return 0
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return t.untyped_storage().nbytes()

    zero_opt = strategy.deepspeed_engine.optimizer
    if strategy.zero_stage_3:
        params = sum(tensor_bytes(p.ds_tensor) for p in module.parameters() if hasattr(p, "ds_tensor"))
        masters = getattr(zero_opt, "fp32_partitioned_groups_flat", [])
    else:
        params = param_bytes(module)
        masters = getattr(zero_opt, "single_partition_of_fp32_groups", [])
    optim = sum(count(t) for t in masters)
    inner = getattr(zero_opt, "optimizer", zero_opt)
    for state in inner.state.values():
        for v in state.values():
            if hasattr(v, "numel") and v.numel() > 1:
                optim += count(v)
    return params, optim
