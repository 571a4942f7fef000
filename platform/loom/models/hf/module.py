"""A transformers decoder's LightningModule (`model=hf_causal_lm`): built from its config, FSDP
units from its `_no_split_modules`, weights read by name from its safetensors or drawn by
transformers' init rule, and split by its own tensor- and pipeline-parallel plans (`parallel`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from loom.data.batch import Batch
from loom.models.hf import config as hf
from loom.models.init import FileInit, NamedInit, own_constants, std_rule
from loom.models.lit import LoomModule, batch_loss

log = logging.getLogger("loom")


class HFCausalLMModule(LoomModule):
    """A transformers AutoModelForCausalLM. FSDP units: the classes the model names in
    `_no_split_modules` (its decoder layers)."""

    def build_model(self) -> nn.Module:
        model = hf.build(self.cfg.model)
        names = set(getattr(model, "_no_split_modules", None) or [])
        self.sharding_units = tuple({type(mod) for mod in model.modules() if type(mod).__name__ in names})
        return model

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        m = self.cfg.model
        weights = hf.safetensors_dir(m)
        if weights is not None:  # each rank reads what it holds of the pretrained safetensors
            return FileInit(str(weights)), None
        if not m.random_init and hf.has_local_weights(str(m.config)):
            return None, "its pretrained weights are .bin files, which transformers loads whole"
        std = float(getattr(meta_model.config, "initializer_range", 0.02))
        return NamedInit(int(self.cfg.seed), std_rule(std, own_constants(meta_model))), None

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """The architecture's own `base_model_tp_plan` on Loom's tensor-parallel mesh."""
        from loom.models.hf import parallel

        n = parallel.apply_tensor_parallel(self.model, tp_mesh)
        log.info(f"tensor parallel: {n} modules of {type(self.model).__name__} split over {tp_mesh.size()} ranks "
                 "by its architecture's base_model_tp_plan")

    def pipeline_chunks(self, net: nn.Module, stages: list[int], n_stages: int) -> list[nn.Module]:
        """This rank's stages of the network, cut along its `base_model_pp_plan`; the network's
        `pipeline_split` then says which stage holds each of its state dict's names."""
        from loom.models.hf import parallel
        from loom.models.pipeline_split import PipelineSplit

        net.pipeline_split = PipelineSplit(*parallel.pipeline_split(net))
        return parallel.pipeline_chunks(net, stages, n_stages)

    def logits(self, x: torch.Tensor, network: nn.Module | None = None) -> torch.Tensor:
        return (network if network is not None else self.model)(input_ids=x, use_cache=False).logits

    def _loss(self, batch: Batch) -> torch.Tensor:
        """Tokens only: checks refuse documents packing (positions) for a transformers model."""
        return batch_loss(self.forward(batch.inputs), batch)


def build(cfg: DictConfig) -> Any:
    return HFCausalLMModule(cfg)
