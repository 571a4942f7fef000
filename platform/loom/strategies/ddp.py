"""`strategy=ddp`: Lightning's DDPStrategy, gradient comm hooks registered on CPU too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout


def _fp16(rank: int, cpu: bool) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"ddp_comm_hook": default_hooks.fp16_compress_hook}


def _bf16(rank: int, cpu: bool) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"ddp_comm_hook": _bf16_compress_on_gloo() if cpu else default_hooks.bf16_compress_hook}


def _powersgd(rank: int, cpu: bool) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    return {"ddp_comm_state": state, "ddp_comm_hook": powerSGD_hook.powerSGD_hook}


# strategy.comm_hook (its valid names: schema.COMM_HOOKS) -> (powersgd rank, on CPU) -> DDPStrategy kwargs
HOOK_BUILDERS: dict[str, Callable[[int, bool], dict[str, Any]]] = {
    "fp16_compress": _fp16, "bf16_compress": _bf16, "powersgd": _powersgd}


def ddp_comm_hook(name: str | None, powersgd_rank: int, cpu: bool = False) -> dict[str, Any]:
    """DDPStrategy kwargs for a gradient-compression hook from torch's default hooks."""
    return {} if name is None else HOOK_BUILDERS[name](powersgd_rank, cpu)


def _bf16_compress_on_gloo():
    """torch's bf16_compress_hook, unchanged, under another name: DDP refuses that hook by its
    name unless CUDA 11+ with NCCL 2.10+ (NCCL's bf16 all-reduce), a guard that does not apply
    to gloo, which all-reduces bf16 tensors on CPU. Without this, the README's
    `strategy.comm_hook=bf16_compress` crashed every CPU run at DDP setup."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_compress_hook_gloo(state, bucket):
        return default_hooks.bf16_compress_hook(state, bucket)

    return bf16_compress_hook_gloo


def _ddp_strategy_class():
    from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
    from pytorch_lightning.strategies import DDPStrategy

    from loom.strategies.base import LoomStrategy

    class LoomDDPStrategy(LoomStrategy, DDPStrategy):
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


def build(cfg: DictConfig, layout: ParallelLayout):
    s = cfg.strategy
    return _ddp_strategy_class()(
        process_group_backend=cfg.hardware.backend,
        find_unused_parameters=s.find_unused_parameters,
        bucket_cap_mb=s.bucket_cap_mb,
        **ddp_comm_hook(s.comm_hook, s.powersgd_rank, cpu=cfg.hardware.accelerator == "cpu"),
    )
