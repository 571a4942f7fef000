"""The MoE family's LightningModule: the balance loss added to the language-model loss, the
expert-load metrics, the aux-loss-free bias update, and the adapter that reads per-expert
checkpoints into the fused expert weights (imports torch, Lightning)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from loom.models.init import NamedInit
from loom.models.lit import DecoderModule
from loom.models.moe.hf_config import per_expert_names
from loom.models.moe.network import MoEDecoderLayer, MoETransformer, moe_rule


def read_per_expert(name: str, keys: set[str], read: Callable[[str], torch.Tensor],
                    rows: range | None = None) -> torch.Tensor | None:
    """A fused expert weight from a per-expert checkpoint (models.init.FileInit's `derive`):
    gate_up_proj [E, 2I, d] = each expert's gate rows then up rows; down_proj [E, d, I]; with
    `rows`, only those experts (an expert-parallel rank reads its own). And Mixtral's
    `block_sparse_moe.gate` for `mlp.gate`."""
    if name.endswith(".mlp.gate.weight"):
        old = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        return read(old) if old in keys else None
    found = per_expert_names(name, keys)
    if found is None:
        return None
    first, second = found
    wanted = rows if rows is not None else range(len(first))
    if not second:  # down_proj
        return torch.stack([read(first[e]) for e in wanted])
    return torch.cat([torch.stack([read(first[e]) for e in wanted]), torch.stack([read(second[e]) for e in wanted])],
                     dim=1)


class MoEModule(DecoderModule):
    """Loom's MoE decoder (loom.models.moe.network), `model=moe*`: FSDP and activation
    checkpointing units are its decoder layers. The loss it trains is the language-model loss
    plus `aux_loss_coef` x the layers' sequence-wise balance loss (both per micro-batch means,
    so gradient accumulation averages them like one big batch)."""

    network = MoETransformer
    sharding_units = (MoEDecoderLayer,)

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self._step_loads: list[torch.Tensor] | None = None  # tokens per expert, this optimizer step
        self.routing: dict[str, Any] = {}  # summary.json's `moe` (`summary_fields`)

    def apply_expert_parallel(self, ep_mesh) -> list[nn.Module]:
        """Each block's experts become DTensors sharded by expert (Shard(0)) over `ep_mesh`:
        this rank computes E / ep of them, on tokens the all-to-all dispatch brings from its ep
        peers (`MoEBlock.ep_group`). Returns the expert modules, for FSDP2 to shard further."""
        from torch.distributed.tensor import DTensor, Shard

        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        out = []
        for block in self.model.moe_blocks():
            experts = block.experts
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                local = full.detach().chunk(ep, dim=0)[rank]
                dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                        stride=full.stride())
                setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
            experts.grad_scale = 1.0 / ep
            block.ep_group = ep_mesh.get_group()
            out.append(experts)
        return out

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        return NamedInit(int(self.cfg.seed), moe_rule()), None

    def weight_adapter(self):
        return read_per_expert

    def _loss(self, batch) -> torch.Tensor:
        return self.with_auxiliary(super()._loss(batch))

    def with_auxiliary(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss plus the routers' balance loss, the experts' loads kept for the step's end
        (a pair objective's step calls it too: its forward ran the same blocks)."""
        if not self.training or self._trainer is None:
            return loss
        loads = [b.load for b in self.model.moe_blocks()]
        self._step_loads = loads if self._step_loads is None else [a + b for a, b in zip(self._step_loads, loads,
                                                                                         strict=True)]
        aux = self.model.balance_loss()
        for block in self.model.moe_blocks():
            block.balance_loss = None
        if aux is None:
            return loss
        self.log("train/moe_aux_loss", aux.detach(), on_step=True, on_epoch=False)
        return loss + aux

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step: the step's tokens per expert, summed over micro-batches and
        data-parallel ranks (one small all-reduce), logged as moe/expert_load_max and _min (the
        busiest and idlest expert over the mean, the worst layer's; 1.0 is perfect balance) and
        moving the aux-loss-free bias (the same update on every rank). Dropless: 0 tokens dropped."""
        if self._step_loads is None or (batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return
        total = self.trainer.strategy.reduce(torch.stack(self._step_loads).float(), reduce_op="sum")
        self._step_loads = None
        ratios = total / total.mean(dim=1, keepdim=True).clamp_min(1e-9)
        high, low = float(ratios.max()), float(ratios.min())
        self.log("moe/expert_load_max", high, on_step=True, on_epoch=False)
        self.log("moe/expert_load_min", low, on_step=True, on_epoch=False)
        # Lightning sends a step's self.log values out with its count of finished steps (this step - 1):
        # "step" puts them, and the aux loss logged in the step, at the step they belong to (train/loss's)
        self.log("step", float(self.trainer.global_step), on_step=True, on_epoch=False)
        worst = self.routing.get("worst_expert_load_max", 0.0)
        self.routing = {"expert_load_max": round(high, 4), "expert_load_min": round(low, 4),
                        "worst_expert_load_max": round(max(worst, high), 4), "dropped_tokens": 0,
                        "tokens_per_expert_last_step": [int(x) for x in total.sum(dim=0).tolist()],
                        "tokens_per_expert_by_layer_last_step": [[int(x) for x in row] for row in total.tolist()],
                        "about": ROUTING_FIGURES}
        if self.model.bias_update_rate:
            self.model.update_correction_bias(list(total))

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's `moe`: the last step's expert load over the mean (max, min), the run's
        worst max, tokens per expert over all layers at the last step, and 0 dropped tokens."""
        return {"moe": self.routing} if self.routing else {}


# summary.json's `moe.about`: what each figure counts (per layer or summed over the MoE layers).
ROUTING_FIGURES = {
    "expert_load_max": "last step: the busiest expert's tokens over its layer's mean, in the layer where that is "
                       "highest (1.0: perfect balance)",
    "expert_load_min": "last step: the idlest expert's tokens over its layer's mean, in the layer where that is lowest",
    "worst_expert_load_max": "the highest expert_load_max of any step so far",
    "tokens_per_expert_last_step": "last step: tokens routed to each expert (once per choice), summed over the MoE "
                                   "layers, micro-batches and data-parallel ranks",
    "tokens_per_expert_by_layer_last_step": "the same per MoE layer: expert_load_max and _min are read from it",
    "dropped_tokens": "tokens no expert took (dropless routing: 0)",
}


def build(cfg: DictConfig) -> Any:
    return MoEModule(cfg)
