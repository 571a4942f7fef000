"""Build the LightningModule of the options without a family folder (mlp, custom) from the frozen
config (imports torch, Lightning); a family builds its own (`<family>/module.py:build`)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.models import custom as custom_module
from loom.models import lit


def mlp(cfg: DictConfig) -> Any:
    from loom.models.mlp import MLPClassifier

    m = cfg.model
    return lit.ClassifierModule(cfg, lambda: MLPClassifier(m.in_features, list(m.hidden), m.num_classes, m.dropout))


def custom(cfg: DictConfig) -> Any:
    """The user's `_target_`: a LightningModule as it is (with Loom's optimizer if it has none
    of its own), or an nn.Module trained with `model.loss` (a class is built by the worker,
    on the meta device when it can be; a factory function's result is used as it is)."""
    import pytorch_lightning as pl
    from torch import nn

    from loom.optim.build import build_optimizer

    m = cfg.model
    loss = custom_module.instantiate(m.loss) if m.loss else None
    if custom_module.kind_of(custom_module.locate(m.module["_target_"])) == "module":
        return lit.WrappedModule(cfg, lambda: custom_module.instantiate(m.module), loss)
    obj = custom_module.instantiate(m.module)
    if isinstance(obj, pl.LightningModule):
        if type(obj).configure_optimizers is pl.LightningModule.configure_optimizers:
            obj.configure_optimizers = lambda: build_optimizer(
                list(obj.named_parameters()), cfg.optim, cfg.trainer.max_steps)
        return obj
    if isinstance(obj, nn.Module):
        return lit.WrappedModule(cfg, lambda: obj, loss, prebuilt=True)
    raise TypeError(f"model.module._target_={m.module.get('_target_')} returned a {type(obj).__name__}, "
                    "not a LightningModule or torch.nn.Module")
