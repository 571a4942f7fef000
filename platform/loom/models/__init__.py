"""Models as config groups (conf/model/): Loom's GPT family, an MLP classifier, transformers
causal LMs from a local config, and your own module (`model=custom`).

This package's top level stays free of torch (`loom.models.spec` and `loom.models.check`
run in the launcher); `build_module` imports torch and Lightning.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def build_module(cfg: DictConfig) -> Any:
    """The run's LightningModule, built from the frozen config (seeded by the caller)."""
    from loom.models import lit

    m, optim, steps = cfg.model, cfg.optim, cfg.trainer.max_steps
    if "n_head" in m:
        return lit.CausalLMModule(m, optim, steps)
    if m.name == "mlp":
        from loom.models.mlp import MLPClassifier

        net = MLPClassifier(m.in_features, list(m.hidden), m.num_classes, m.dropout)
        return lit.ClassifierModule(net, optim, steps)
    if m.name == "hf_causal_lm":
        return lit.HFCausalLMModule(m, optim, steps)
    if m.name == "custom":
        return _custom(cfg)
    raise ValueError(f"unknown model {m.name}")


def _custom(cfg: DictConfig) -> Any:
    import pytorch_lightning as pl
    from torch import nn

    from loom.models import custom, lit
    from loom.optim import build_optimizer

    m = cfg.model
    obj = custom.instantiate(m.module)
    if isinstance(obj, pl.LightningModule):
        if type(obj).configure_optimizers is pl.LightningModule.configure_optimizers:
            # No optimizer of its own: Loom's (optim group), like every other model.
            obj.configure_optimizers = lambda: build_optimizer(
                list(obj.named_parameters()), cfg.optim, cfg.trainer.max_steps)
        return obj
    if isinstance(obj, nn.Module):
        loss = custom.instantiate(m.loss) if m.loss else None
        return lit.WrappedModule(obj, loss, cfg.optim, cfg.trainer.max_steps)
    raise TypeError(f"model.module._target_={m.module.get('_target_')} returned a {type(obj).__name__}, "
                    "not a LightningModule or torch.nn.Module")
