"""The LightningModules Loom builds from `model=...`.

Every one keeps the trained network as `self.model` (the plain nn.Module whose state_dict is
the run's final weights, and what FSDP/TP shard), declares `sharding_units` (the module
classes FSDP shards as units) and takes Loom's optimizer and schedule (loom.optim). A
user's own LightningModule (`model=custom`) is used as it is.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from loom.models.gpt import GPT, Block
from loom.optim.build import build_optimizer


class LoomModule(pl.LightningModule):
    sharding_units: tuple[type, ...] = ()
    tensor_parallel_plan: dict[type, dict[str, str]] = {}

    def __init__(self, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__()
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps

    def configure_model(self) -> None:
        """Lightning calls this before the optimizers are built. The model itself is built in
        __init__ (same seed, same initial weights under every strategy); a strategy that
        shards it (Loom's ModelParallelStrategy: FSDP2 / TP) does so here, once."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        parallelize = getattr(strategy, "parallelize", None)
        if parallelize is not None and not getattr(self, "_parallelized", False):
            parallelize(self)
            self._parallelized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def _loss(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return build_optimizer(list(self.model.named_parameters()), self.optim_cfg, self.max_steps)


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class CausalLMModule(LoomModule):
    """Loom's GPT (loom.models.gpt), `model=gpt_*`."""

    sharding_units = (Block,)
    # Tensor parallelism, per unit class: submodule -> colwise | rowwise (Megatron-style:
    # q/k/v and the MLP's up projection split by output features, i.e. by heads; the two
    # output projections by input features, so each unit needs one all-reduce per branch).
    tensor_parallel_plan = {
        Block: {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
                "mlp.fc": "colwise", "mlp.proj": "rowwise"},
    }

    def __init__(self, model_cfg: DictConfig, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__(optim_cfg, max_steps)
        self.model_cfg = model_cfg
        m = OmegaConf.to_container(model_cfg)
        m.pop("name")
        self.model = GPT(**m)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return _lm_loss(self.model(x), y)


class HFCausalLMModule(LoomModule):
    """A transformers AutoModelForCausalLM, `model=hf_causal_lm`. FSDP units: the classes the
    model names in `_no_split_modules` (its decoder layers)."""

    def __init__(self, model_cfg: DictConfig, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__(optim_cfg, max_steps)
        from loom.models import hf

        self.model = hf.build(model_cfg)
        names = set(getattr(self.model, "_no_split_modules", None) or [])
        self.sharding_units = tuple({type(mod) for mod in self.model.modules() if type(mod).__name__ in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return _lm_loss(self.forward(x), y)


class ClassifierModule(LoomModule):
    """Cross-entropy classification, `model=mlp`; logs val/acc next to val/loss."""

    def __init__(self, model: nn.Module, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__(optim_cfg, max_steps)
        self.model = model

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).float(), y)

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x).float()
        loss = F.cross_entropy(logits, y)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)
        return loss


class WrappedModule(LoomModule):
    """A user's nn.Module + a loss (`model=custom` with a plain module): loss(model(x), y).
    Outputs with one more dimension than the targets beyond (batch, classes), e.g. a language
    model's (B, T, V) logits for (B, T) targets, are flattened to (B*T, V) first."""

    def __init__(self, model: nn.Module, loss: nn.Module | None, optim_cfg: DictConfig, max_steps: int) -> None:
        super().__init__(optim_cfg, max_steps)
        self.model = model
        self.loss_fn = loss if loss is not None else nn.CrossEntropyLoss()
        self.sharding_units = tuple(getattr(model, "sharding_units", ()))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        out = self.model(x)
        if out.dim() > 2 and out.dim() == y.dim() + 1:
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return self.loss_fn(out.float() if out.is_floating_point() else out, y)
