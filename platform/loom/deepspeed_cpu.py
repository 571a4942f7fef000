"""DeepSpeed ZeRO on CPU processes (gloo, fp32): a thin subclass of Lightning's DeepSpeedStrategy.

Written by hand because Lightning refuses it: `DeepSpeedStrategy.setup_environment` raises
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

from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy


def use_cpu_accelerator() -> None:
    """Select DeepSpeed's CPU accelerator; must run before `import deepspeed`.

    Also marks DeepSpeed's shared-memory all-reduce op (`deepspeed_shm_comm`) unavailable:
    its CPU comm backend otherwise JIT-compiles it with g++/ninja on first use (about a
    minute, both ranks at once) although only inference all-reduce uses it; training
    collectives go through torch.distributed (gloo) either way.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.accelerator as dsa

    if dsa.get_accelerator().device_name() != "cpu":  # imported earlier with another choice
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        dsa.set_accelerator(CPU_Accelerator())
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
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
        return engine, ds_optimizer
