"""The Llama family's LightningModule: its network, FSDP units, tensor-parallel plan and init
rule (imports torch, Lightning)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torch import nn

from loom.models.init import NamedInit
from loom.models.lit import DecoderModule
from loom.models.llama.network import DecoderLayer, Llama, llama_rule


class LlamaModule(DecoderModule):
    """Loom's Llama (loom.models.llama.network), `model=llama*`: FSDP and activation
    checkpointing units are its decoder layers; its pipeline split is the network's
    (`Llama.pipeline_split`)."""

    network = Llama
    sharding_units = (DecoderLayer,)
    # transformers' `base_model_tp_plan` and torchtitan's llama3 plan: q/k/v and the SwiGLU's gate
    # and up projections split by output features (whole query and key/value heads per rank:
    # validation asks tp to divide n_kv_heads), o and down by input features: one all-reduce per
    # branch. Embedding and head stay whole on every TP rank (FSDP2 shards them over the
    # data-parallel ranks), as for the GPT, so the loss path is the same; a tied head then
    # reads the same whole embedding, with no special case.
    tensor_parallel_plan = {
        DecoderLayer: {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                       "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                       "mlp.down_proj": "rowwise"},
    }

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        return NamedInit(int(self.cfg.seed), llama_rule()), None


def build(cfg: DictConfig) -> Any:
    return LlamaModule(cfg)
