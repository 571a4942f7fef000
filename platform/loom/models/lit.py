"""The LightningModule for causal language models (the GPT of loom.models.gpt)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from loom.models.gpt import GPT, Block
from loom.optim import build_optimizer


class CausalLMModule(pl.LightningModule):
    # The module classes FSDP shards as units, and which make up the TP plan.
    sharding_units: tuple[type, ...] = (Block,)

    def __init__(self, model_cfg: DictConfig, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__()
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        m = OmegaConf.to_container(model_cfg)
        m.pop("name")
        self.model = GPT(**m)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return build_optimizer(list(self.model.named_parameters()), self.optim_cfg, self.max_steps)
