"""The LightningModule for causal language models (the GPT of loom.models.gpt)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from loom.models.gpt import GPT, Block
from loom.optim import build_optimizer


class CausalLMModule(pl.LightningModule):
    # The module classes FSDP shards as units (strategy.shard_units overrides them by name).
    sharding_units: tuple[type, ...] = (Block,)
    # Tensor parallelism, per unit class: submodule -> colwise | rowwise (Megatron-style:
    # q/k/v and the MLP's up projection split by output features, i.e. by heads; the two
    # output projections by input features, so each unit needs one all-reduce per branch).
    tensor_parallel_plan: dict[type, dict[str, str]] = {
        Block: {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
                "mlp.fc": "colwise", "mlp.proj": "rowwise"},
    }

    def __init__(self, model_cfg: DictConfig, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__()
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        m = OmegaConf.to_container(model_cfg)
        m.pop("name")
        self.model = GPT(**m)

    def configure_model(self) -> None:
        """Lightning calls this before the optimizers are built. The model itself is built in
        __init__ (same seed, same initial weights under every strategy); a strategy that
        shards it (Loom's ModelParallelStrategy: FSDP2 / TP) does so here, once."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        parallelize = getattr(strategy, "parallelize", None)
        if parallelize is not None and not getattr(self, "_parallelized", False):
            parallelize(self)
            self._parallelized = True

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
