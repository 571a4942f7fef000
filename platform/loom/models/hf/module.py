"""A transformers decoder's LightningModule (`model=hf_causal_lm`): built from its config, FSDP
units from its `_no_split_modules`, weights read by name from its safetensors or drawn by
transformers' init rule, and split by its own tensor- and pipeline-parallel plans (`parallel`).
With `model.head=score` the network is its `...ForSequenceClassification` (num_labels=1): the base
reads a causal LM's weights by the same names, the score head is drawn (loom.models.heads), and
`sequence_scores` reads each row's score at its last real token."""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from loom.data.batch import IGNORE_INDEX, Batch
from loom.models.heads import head_of
from loom.models.hf import config as hf
from loom.models.init import Derive, FileInit, NamedInit, own_constants, std_rule
from loom.models.lit import LoomModule, batch_loss

log = logging.getLogger("loom")


class HFCausalLMModule(LoomModule):
    """A transformers AutoModelForCausalLM (model.head=score: AutoModelForSequenceClassification). FSDP
    units: the classes the model names in `_no_split_modules` (its decoder layers)."""

    head_shapes: dict[str, tuple[int, ...]] = {}  # model.head=score: the head's parameters (set by build_model)
    _context: Any = None  # strategy.cp: this rank's ContextShard (loom.models.hf.context)
    _scores: list[torch.Tensor] | None = None  # model.head=score: where the head's output lands (_score_tap)
    std = 0.02

    def build_model(self) -> nn.Module:
        model = hf.build(self.cfg.model)
        names = set(getattr(model, "_no_split_modules", None) or [])
        self.sharding_units = tuple({type(mod) for mod in model.modules() if type(mod).__name__ in names})
        head = head_of(self.cfg.model)
        self.head_shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if head.owns(n)}
        self.std = float(getattr(model.config, "initializer_range", 0.02))
        self._scores = _score_tap(model) if head.own else None
        return model

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        m = self.cfg.model
        weights = hf.safetensors_dir(m)
        self._say_head(weights)
        if weights is not None:  # each rank reads what it holds of the pretrained safetensors
            return FileInit(str(weights), self.weight_adapter()), None
        if not m.random_init and hf.has_local_weights(str(m.config)):
            return None, "its pretrained weights are .bin files, which transformers loads whole"
        return NamedInit(int(self.cfg.seed), std_rule(self.std, own_constants(meta_model))), None

    def weight_adapter(self) -> Derive | None:
        """A causal LM's weights hold no score head: it is drawn as a fresh init draws it (the std
        rule, seeded by the run seed and its name), whole; every other name is read as it is."""
        if not self.head_shapes:
            return None
        draw, shapes = NamedInit(int(self.cfg.seed), std_rule(self.std)), dict(self.head_shapes)

        def derive(name: str, _keys: set[str], _get: Any, _rows: range | None) -> torch.Tensor | None:
            shape = shapes.get(name)
            return None if shape is None else draw.full_value(name, shape, torch.device("cpu"))

        return derive

    def _say_head(self, weights: Any) -> None:
        """One log line: where a score head's base comes from, and that the head is drawn."""
        if not self.head_shapes:
            return
        m, source = self.cfg.model, getattr(self, "init_source", None)
        if source is None and weights is None and hf.loads_whole(m):
            log.info(f"model.head={m.head}: the base from model.config={m.config}'s .bin weights through transformers' "
                     f"from_pretrained, which draws {', '.join(self.head_shapes)} by its own init")
            return
        base = f"model.init_from={source}" if source is not None else f"model.config={m.config}" if weights else None
        log.info(f"model.head={m.head}: {', '.join(self.head_shapes)} drawn by the std rule (normal(0, {self.std}), "
                 "seeded by name); " + (f"the base from {base} (a causal LM's weights: its lm_head unused)" if base
                                       else "the base drawn too (no causal LM's weights)"))

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
        """The causal LM's logits (N, T, V); with model.head=score, each token's score (N, T)."""
        if self._scores is not None:
            return self.token_scores(x)
        return (network if network is not None else self.model)(input_ids=x, use_cache=False).logits

    def token_scores(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T): the score head on the base's last hidden states, at every position. The whole
        network runs (FSDP2's root hooks gather its parameters) and the head's output is tapped, so
        transformers' pooling at `pad_token_id` (which raises on a batch without one) is not used."""
        if self._scores is None:
            raise RuntimeError(f"token and sequence scores need model.head=score; this run's model.head="
                               f"{self.cfg.model.get('head') or 'lm'} has no score head (it is a causal LM)")
        self._scores.clear()
        pooled = self.model(input_ids=x, use_cache=False).logits
        # The pooled output joins at zero weight: FSDP2 unshards the root's parameters (the score head's
        # among them) for backward from a hook on the module's output, which the tapped tensor alone
        # would never reach (seen: "setStorage ... storage of size 0" in backward under fsdp, 2 ranks).
        return self._scores.pop()[..., 0] + 0.0 * pooled.sum()

    def sequence_scores(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(N,): each row's score at its last real token (`last_token`): a reward model's Bradley-Terry
        score of the sequence, whatever padding follows it."""
        scores = self.token_scores(inputs)
        return scores.gather(1, last_token(targets)[:, None]).squeeze(1)

    def context_parallel(self, mesh: Any, style: str) -> None:
        """Ulysses through transformers' attention interface (`hf/context.py`; ring is refused at validation)."""
        from loom.models.context_parallel import ContextShard
        from loom.models.hf import context

        self._context = ContextShard(mesh.get_group(), mesh.size(), mesh.get_local_rank(), style)
        n = context.apply(self.model, self._context)
        log.info(f"context parallelism: each sequence split over cp={mesh.size()} ranks ({style}), this rank's "
                 f"chunks {self._context.chunks()} of {mesh.size()}; {n} attention modules of "
                 f"{type(self.model).__name__} through transformers' AttentionInterface ({context.NAME})")

    def _loss(self, batch: Batch) -> torch.Tensor:
        """Tokens only: checks refuse documents packing (positions) for a transformers model. Under
        context parallelism, this rank's share of the whole sequences' loss (`local_loss`)."""
        if self._context is None:
            return batch_loss(self.forward(batch.inputs), batch)
        from loom.models.context_parallel import local_loss
        from loom.models.hf import context

        logits = context.logits(self.model, batch.inputs, self._context)
        return local_loss(logits, batch.targets, self._context, batch.loss_scale, None)


def last_token(targets: torch.Tensor) -> torch.Tensor:
    """(N,) the input position of each row's last real token: just after its last trained target
    (targets[t] is inputs[t + 1], so the completion's last token), clamped to T - 1; 0 for a row
    without one."""
    T = targets.shape[-1]
    pos = torch.arange(T, device=targets.device).expand_as(targets)
    last = torch.where(targets != IGNORE_INDEX, pos, torch.full_like(pos, -1)).amax(-1)
    return (last + 1).clamp(0, T - 1)


def _score_tap(model: nn.Module) -> list[torch.Tensor]:
    """A list holding the score head's output of the latest forward (a hook on transformers' `score`)."""
    held: list[torch.Tensor] = []

    def tap(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
        held[:] = [out]  # the latest only: a forward that does not read it holds no more than one

    model.get_submodule("score").register_forward_hook(tap)
    if model.config.get_text_config().pad_token_id is None:  # transformers' pooling raises without one; its
        model.config.get_text_config().pad_token_id = 0  # result is unused here (export sets the tokenizer's)
    return held


def build(cfg: DictConfig) -> Any:
    return HFCausalLMModule(cfg)
