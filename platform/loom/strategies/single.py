"""`strategy=single`: one process, Lightning's SingleDeviceStrategy."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.layout import ParallelLayout


def build(cfg: DictConfig, layout: ParallelLayout):
    import torch
    from pytorch_lightning.strategies import SingleDeviceStrategy

    from loom.strategies.base import LoomStrategy

    class LoomSingleDeviceStrategy(LoomStrategy, SingleDeviceStrategy):
        """The strategy Lightning's "auto" picks for one device, with Loom's state methods."""

    device = torch.device("cuda", 0) if cfg.hardware.accelerator == "gpu" else torch.device("cpu")
    return LoomSingleDeviceStrategy(device=device)
