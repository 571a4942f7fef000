"""The GPT family's LightningModule: its network, FSDP units, tensor-parallel plan, init rule
and the adapter that reads older weights with separate q/k/v (imports torch, Lightning)."""

from __future__ import annotations

from functools import partial
from typing import Any

from omegaconf import DictConfig
from torch import nn

from loom.models.gpt.network import GPT, Block, gpt_rule, read_fused_qkv
from loom.models.init import Derive, NamedInit
from loom.models.lit import DecoderModule


class GPTModule(DecoderModule):
    """Loom's GPT (loom.models.gpt.network), `model=gpt_*`."""

    network = GPT
    sharding_units = (Block,)
    # Tensor parallelism, per unit class: submodule -> colwise | rowwise (Megatron-style:
    # the fused qkv and the MLP's up projection split by output features, i.e. by heads (qkv's
    # rows are grouped by head, loom.models.gpt.network, so a contiguous split holds whole heads
    # of q, k and v); the two output projections by input features: one all-reduce per branch).
    tensor_parallel_plan = {
        Block: {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"},
    }

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        return NamedInit(int(self.cfg.seed), gpt_rule(int(self.cfg.model.n_layer))), None

    def weight_adapter(self) -> Derive:
        """model.init_from: weights saved with separate attn.q/k/v (Loom before the fused layout)
        are fused as they are read."""
        m = self.cfg.model
        return partial(read_fused_qkv, head_dim=int(m.d_model) // int(m.n_head))


def build(cfg: DictConfig) -> Any:
    return GPTModule(cfg)
