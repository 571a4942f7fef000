"""Build the Lightning strategy named by `cfg.strategy` for the resolved hardware."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


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


def build_strategy(cfg: DictConfig):
    s, hw = cfg.strategy, cfg.hardware
    if s.name == "single":
        return "auto"
    if s.name == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        return DDPStrategy(
            process_group_backend=hw.backend,
            find_unused_parameters=s.find_unused_parameters,
            bucket_cap_mb=s.bucket_cap_mb,
            **ddp_comm_hook(s.comm_hook, s.powersgd_rank),
        )
    raise ValueError(f"unknown strategy {s.name}")


def data_parallel(cfg: DictConfig, global_rank: int, world_size: int) -> tuple[int, int]:
    """(rank, size) along the data-parallel dimension: the sampler shards by these."""
    return global_rank, world_size


def full_model_state(trainer, module) -> dict:
    """The consolidated (unsharded) model state dict; a collective, call it on every rank."""
    return module.model.state_dict()
