"""`strategy=zero1|zero2|zero3|zero3_offload`: DeepSpeed ZeRO through Lightning's DeepSpeedStrategy;
on CPU processes (gloo, fp32) through a thin subclass of it.

The CPU subclass is written by hand because Lightning refuses it: `DeepSpeedStrategy.setup_environment` raises
unless the accelerator is CUDA, `_validate_device_index_selection` rejects CPU devices (they
have no index) and `deepspeed.initialize(args.device_rank=None)` fails on them. DeepSpeed
itself runs ZeRO 1-3 on CPU (its CPU accelerator, selected with DS_ACCELERATOR=cpu before
deepspeed is imported, falls back to gloo when oneCCL is absent). This subclass only skips
the CUDA guard, initializes the process group itself through DeepSpeed (gloo) and passes the
local rank as DeepSpeed's device rank. Everything else (engine, checkpoints, clipping) is
Lightning's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from loom.layout import ParallelLayout
from loom.models.lora_checks import lora_on
from loom.strategies import deepspeed_universal
from loom.strategies.base import LoomStrategy, param_bytes, tensor_bytes
from loom.strategies.deepspeed_config import resolved_deepspeed_config


def import_deepspeed() -> None:
    """`import deepspeed` without the mlflow its autotuner imports whenever mlflow is installed.

    deepspeed/__init__ -> runtime.config -> autotuning.autotuner runs `try: import mlflow` at
    import, for an autotuner Loom never runs. Once `loom[tracking]` installed mlflow-skinny, that
    pulled mlflow, pandas, opentelemetry and fastapi into every ZeRO rank: +0.12 GiB of RSS each
    (the zero3 build of gpt_1b, 4 layers, read 0.75x DDP's above a plain process instead of
    0.58x). mlflow is hidden only while DeepSpeed imports; tracking=mlflow imports it as usual.
    """
    if "deepspeed" in sys.modules:
        return
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def use_cpu_accelerator() -> None:
    """Select DeepSpeed's CPU accelerator; must run before `import deepspeed`.

    Also marks DeepSpeed's shared-memory all-reduce op (`deepspeed_shm_comm`) unavailable:
    its CPU comm backend otherwise JIT-compiles it with g++/ninja on first use (about a
    minute, both ranks at once) although only inference all-reduce uses it; training
    collectives go through torch.distributed (gloo) either way.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import_deepspeed()
    import deepspeed.accelerator as dsa

    if dsa.get_accelerator().device_name() != "cpu":  # imported earlier with another choice
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        dsa.set_accelerator(CPU_Accelerator())
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class LoomDeepSpeedStrategy(LoomStrategy, DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with Loom's state methods, resuming at any data-parallel
    world size (`deepspeed_universal`)."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """A checkpoint of another data-parallel world size loads through its universal form
        (`deepspeed_universal`); Lightning's client state (loops, callbacks, step) comes from the
        original rank 0's file, which the converter copies into it."""
        universal = deepspeed_universal.prepare(self, Path(checkpoint_path)) if Path(checkpoint_path).is_dir() \
            else None
        if universal is None:
            with _strict_adapter_keys(self.deepspeed_engine, self.lightning_module):
                return super().load_checkpoint(checkpoint_path, weights_only)
        with deepspeed_universal.loading_universal(self.deepspeed_engine, self.config, universal):
            return super().load_checkpoint(universal, weights_only)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        log_offload(engine)
        return engine, ds_optimizer

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """Lightning already divides the loss by `accumulate_grad_batches`; DeepSpeed's
        `engine.backward` would divide it again (`scale_wrt_gas`, Lightning issue #6170), so
        with accumulation N the gradients were 1/N^2 of the mean and clipping cut a different
        step than at accumulation 1. Once is right: a world change re-derives the accumulation
        and must leave the update as it was. (`manual_backward` is not divided by Lightning.)"""
        if self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def full_shape(self, t) -> tuple[int, ...]:
        """ZeRO-3 parameters are empty locally; `ds_shape` is their real shape."""
        return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)

    def gather_full_tensor(self, trainer, t):
        """One parameter whole on rank 0's CPU, from the optimizer's fp32 master when the module
        holds a lower precision (bf16/fp16 training: `safe_get_full_fp32_param`, an all-reduce
        over the data-parallel group), else the parameter itself (ZeRO-3: gathered for the
        moment of the copy). One tensor at a time, so no rank holds two full copies."""
        import deepspeed
        import torch
        from deepspeed.utils import safe_get_full_fp32_param

        rank0 = trainer.is_global_zero
        if isinstance(t, torch.nn.Parameter) and t.dtype in (torch.bfloat16, torch.float16):
            master = safe_get_full_fp32_param(t)
            if master is not None:
                return master.detach().cpu() if rank0 else None
        if hasattr(t, "ds_id"):
            with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                return t.detach().to("cpu", copy=True) if rank0 else None
        return t.detach().cpu() if rank0 else None

    def local_state_bytes(self, trainer, module) -> tuple[int, int]:
        """- ZeRO-1/2: parameters are whole on every rank. Optimizer state = this rank's fp32
          master partition (`single_partition_of_fp32_groups`, kept even in fp32 runs;
          BF16_Optimizer's `fp32_groups_flat_partition` for bf16 at stage 1) plus the
          inner optimizer's m and v for that partition (the ZeRO paper's 12 bytes/param / N).
        - ZeRO-3: parameters = each parameter's local partition (`p.ds_tensor`); optimizer state
          = the fp32 master partitions (`fp32_partitioned_groups_flat`) plus m and v. With
          offload these live in host memory but are still this rank's.
        Tensors sharing storage are counted once."""
        seen: set[int] = set()

        def count(t) -> int:
            if t is None or t.numel() == 0:
                return 0
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return 0
            seen.add(ptr)
            return t.untyped_storage().nbytes()

        zero_opt = self.deepspeed_engine.optimizer
        if self.zero_stage_3:
            params = sum(tensor_bytes(p.ds_tensor) for p in module.parameters() if hasattr(p, "ds_tensor"))
            masters = getattr(zero_opt, "fp32_partitioned_groups_flat", [])
        else:
            params = param_bytes(module)
            # bf16 + fp32 grad accumulation at stage 1 runs DeepSpeed's BF16_Optimizer instead
            masters = getattr(zero_opt, "single_partition_of_fp32_groups", None) \
                or getattr(zero_opt, "fp32_groups_flat_partition", [])
        optim = sum(count(t) for t in masters)
        inner = getattr(zero_opt, "optimizer", zero_opt)
        for state in inner.state.values():
            for v in state.values():
                if hasattr(v, "numel") and v.numel() > 1:
                    optim += count(v)
        return params, optim


@contextmanager
def _strict_adapter_keys(engine, module) -> Iterator[None]:
    """A LoRA run's checkpoint is saved without the frozen base (`exclude_frozen_parameters`) and
    loaded non-strictly (the module's `strict_loading`): check here that its module state holds
    exactly the adapter's parameters, strict for those (loom.models.lora.check_keys)."""
    from loom.models.lora import adapter_only, check_keys, trainable_keys

    if not adapter_only(module):
        yield
        return
    original = engine.load_module_state_dict

    def load_module_state_dict(checkpoint, *args, **kwargs):
        check_keys(checkpoint["module"], trainable_keys(module), "the DeepSpeed checkpoint")
        return original(checkpoint, *args, **kwargs)

    engine.load_module_state_dict = load_module_state_dict
    try:
        yield
    finally:
        del engine.load_module_state_dict  # the class's method again


class CPUDeepSpeedStrategy(LoomDeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, minus its CUDA-only guards (see the module docstring)."""

    strategy_name = "loom_deepspeed_cpu"

    def setup_environment(self) -> None:
        # DeepSpeedStrategy.setup_environment = CUDA check + DDPStrategy.setup_environment.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning_fabric.utilities.seed import reset_seed

        # As DeepSpeedStrategy.setup_distributed, without the device-index validation.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = "gloo"
        self._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        return "gloo"

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import argparse

        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        log_offload(engine)
        return engine, ds_optimizer


def log_offload(engine) -> None:
    """What the ZeRO-3 optimizer offloads, read back from it (its `offload_param` and
    `offload_optimizer` flags): the log says what runs, not what the config asked for."""
    import logging

    opt = engine.optimizer
    if hasattr(opt, "offload_param"):
        logging.getLogger("loom").info(f"zero3: parameter partitions offloaded: {bool(opt.offload_param)}, "
                                       f"optimizer states offloaded: {bool(opt.offload_optimizer)}")


def build(cfg: DictConfig, layout: ParallelLayout):
    hw = cfg.hardware
    ds_config = resolved_deepspeed_config(cfg, layout)
    # Lightning fills this in from Trainer(accumulate_grad_batches) and refuses it in the dict.
    ds_config.pop("gradient_accumulation_steps", None)
    # Checked against `optim` and shown in plan.json, but not DeepSpeed's to build: with an
    # optimizer block Lightning would let DeepSpeed replace Loom's optimizer (and schedule).
    ds_config.pop("optimizer", None)
    ds_config.pop("scheduler", None)
    frozen_out = lora_on(cfg.model)  # a LoRA checkpoint holds the adapter alone (loom.models.lora)
    if hw.accelerator == "cpu":
        use_cpu_accelerator()
        return CPUDeepSpeedStrategy(config=ds_config, process_group_backend="gloo", exclude_frozen_parameters=frozen_out)
    import_deepspeed()
    return LoomDeepSpeedStrategy(config=ds_config, process_group_backend=hw.backend,
                                 exclude_frozen_parameters=frozen_out)
