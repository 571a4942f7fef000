"""The training and validation step of a pair objective (dpo, ipo, simpo, reward), and its reference.

The worker hands the LightningModule a `PairStep` (`module.pair_step`); the module's loss, its
`configure_model` and `on_fit_start` call it (loom.models.lit), so the model families know nothing
of objectives. A micro batch of preference pairs (`Batch.pairs`: inputs (B, 2, T)) runs as one
forward over its 2B rows, chosen and rejected of a pair side by side on the same rank; each row's
completion log-probability is summed over its trained targets (`losses.sequence_logps`), the
reference's comes from one of three places (loom.objectives.reference), and `losses.pair_loss` turns
them into the loss (a mean over pairs, so the mean over micro batches and ranks is the global
batch's) and the figures logged each step: rewards of chosen and rejected, their margin, accuracy.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from loom.data.batch import IGNORE_INDEX, Batch, collate
from loom.objectives import option_of, reference_of
from loom.objectives.losses import PairTerms, pair_loss, sequence_logps
from loom.objectives.reference import reference_path

log = logging.getLogger("loom")
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def for_run(cfg: DictConfig) -> PairStep | None:
    """A PairStep when the run's objective trains on preference pairs, else None."""
    return PairStep(cfg) if option_of(cfg).pairs else None


class PairStep:
    """One run's pair objective: its loss per micro batch, its reference, its summary figures."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg, self.objective = cfg, cfg.objective
        self.mode = reference_of(cfg)          # adapters | precompute | online | None
        self.scores = option_of(cfg).score_head  # a scalar head's scores instead of log-probs
        self.online: list[torch.nn.Module] = []  # the frozen copy (a list: not a submodule of the module)
        self.last: torch.Tensor | None = None    # the last training step's LOGGED figures, mean over the ranks
        self.precomputed: dict[str, str] = {}    # split -> "computed" | "read" (summary.json)
        self.checked: set[bool] = set()          # phases (module.training) whose batches held their reference
        self.tuners: list | None = None          # the LoRA layers the adapters-off reference switches

    # ------------------------------------------------------------------ the step
    def loss(self, module: Any, batch: Batch) -> torch.Tensor:
        b, _, t = batch.inputs.shape
        x, y = batch.inputs.reshape(2 * b, t), batch.targets.reshape(2 * b, t)
        ref = self._reference(module, batch, x, y)  # first: what a forward leaves behind (MoE loads) is the policy's
        if self.scores:
            own, counts = module.sequence_scores(x, y).float(), (y != IGNORE_INDEX).sum(-1).float()
        else:
            own, counts = sequence_logps(module.logits(x), y, module._vocab_used)
        own, counts = own.view(b, 2), counts.view(b, 2)
        terms = PairTerms(own[:, 0], own[:, 1], counts[:, 0], counts[:, 1],
                          None if ref is None else ref[:, 0], None if ref is None else ref[:, 1])
        loss, figures = pair_loss(self.objective, terms)
        self._log(module, figures)
        return module.with_auxiliary(loss)

    def _reference(self, module: Any, batch: Batch, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """(B, 2) reference log-probs of the micro batch's pairs, or None (a reference-free objective)."""
        if self.mode is None:
            return None
        if self.mode == "precompute":
            ref = batch.reference
            if module.training not in self.checked:  # the first batch of each phase (a host sync: not every step)
                if ref is None or bool(ref.isnan().any()):
                    raise RuntimeError("objective.reference=precompute: a batch reached the step without its "
                                       "reference log-probs (the pass before training did not set them on the dataset)")
                self.checked.add(module.training)
            return ref.to(torch.float32)
        return self.reference_logps(module, x, y).view(-1, 2)

    @torch.no_grad()
    def reference_logps(self, module: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-row reference log-probs: the frozen copy, or the base with its adapters off, in eval
        mode (the reference is a fixed function: no dropout)."""
        from loom.models.lora import adapters_off, tuner_layers

        net = self.online[0] if self.mode == "online" else module.model
        was = net.training
        net.eval()
        try:
            if self.mode == "adapters":
                if self.tuners is None:  # found once: a walk over every module per step would cost the step
                    self.tuners = tuner_layers(net)
                with adapters_off(self.tuners):
                    logits = module.logits(x, net)
            else:
                logits = module.logits(x, net)
        finally:
            net.train(was)
        return sequence_logps(logits, y, module._vocab_used)[0]

    def _log(self, module: Any, figures: dict[str, torch.Tensor]) -> None:
        """Training: the step's figures averaged over the data-parallel ranks in one all-reduce (no host
        sync), as train/loss is; validation: Lightning's mean over the epoch and the ranks."""
        values = torch.stack([figures[k] for k in LOGGED])
        if not module.training:
            for name, value in zip(LOGGED, values, strict=True):
                module.log(f"val/{name}", value, on_step=False, on_epoch=True, sync_dist=True)
            return
        if module._trainer is not None:
            values = module.trainer.strategy.reduce(values, reduce_op="mean")
            module.log("step", float(module.trainer.global_step + 1), on_step=True, on_epoch=False)  # not the step
            # before, where Lightning would write them (moe/module.py)
        for name, value in zip(LOGGED, values, strict=True):
            module.log(f"train/{name}", value, on_step=True, on_epoch=False)
        self.last = values

    # ------------------------------------------------------------------ before training
    def build_online(self, module: Any, strategy: Any) -> None:
        """The frozen copy for objective.reference=online: the module's own build once more (the same
        init, init_from file and sharding as the policy), kept outside the module's parameters."""
        from loom.models.construct import construct

        policy = module.model
        construct(module, strategy)
        copy = module.model
        module.model = policy
        for p in copy.parameters():
            p.requires_grad_(False)
        copy.eval()
        self.online = [copy]
        log.info("objective reference: a frozen copy of the starting weights, built and sharded like the policy")

    def before_training(self, module: Any, trainer: Any) -> None:
        """objective.reference=precompute: every pair's reference log-probs set on the train and validation
        sets, read from beside the data or computed now by the policy (still the reference: the first
        step has not run). online: the copy cast to the policy's dtype where the strategy cast it."""
        if self.mode == "online":
            _match_dtype(self.online[0], module.model)
        if self.mode != "precompute":
            return
        dm = trainer.datamodule
        for split, samples in (("train", dm.train_set), ("val", dm.val_set)):
            if samples is not None:
                samples.reference = self._split_reference(module, trainer, samples, split)

    def _split_reference(self, module: Any, trainer: Any, samples: Any, split: str) -> np.ndarray:
        from loom.atomic import atomic_path

        strategy = trainer.strategy
        path = reference_path(samples, self.cfg)
        found = np.load(path) if strategy.global_rank == 0 and path.is_file() else None
        found = strategy.broadcast(found, src=0)  # rank 0's answer on every rank (a node without the file too)
        if found is not None and found.shape == (len(samples), 2):
            self.precomputed[split] = "read"
            log.info(f"objective reference: {split} log-probs of {len(samples):,} pairs read from {path}")
            return found
        if trainer.ckpt_path is not None:
            raise RuntimeError(
                f"objective.reference=precompute: resuming, but the reference log-probs of the {split} pairs "
                f"are not at {path} (the cache was cleared?); the policy has trained since, so it can no longer "
                "stand for the reference: start again, or resume with objective.reference=online")
        values = self._compute(module, trainer, samples)
        if strategy.global_rank == 0:
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, values)
        strategy.barrier()
        self.precomputed[split] = "computed"
        log.info(f"objective reference: {split} log-probs of {len(samples):,} pairs computed, stored at {path}")
        return values

    @torch.no_grad()
    def _compute(self, module: Any, trainer: Any, samples: Any) -> np.ndarray:
        """The policy's log-probs of every pair, the pairs dealt round-robin to the ranks in equal
        counts (every rank runs as many forwards: they are collectives under sharding)."""
        strategy, bs = trainer.strategy, int(self.cfg.dataset.batch_size)
        world, rank, n = trainer.world_size, trainer.global_rank, len(samples)
        per_rank = math.ceil(n / world)
        mine = [min(rank + world * k, n - 1) for k in range(per_rank)]
        out = torch.empty(per_rank, 2, dtype=torch.float32, device=strategy.root_device)
        net = module.model
        was = net.training
        net.eval()
        try:
            with trainer.precision_plugin.val_step_context():
                for lo in range(0, per_rank, bs):
                    batch = collate([samples[i] for i in mine[lo:lo + bs]])
                    b, _, t = batch.inputs.shape
                    x = batch.inputs.reshape(2 * b, t).to(strategy.root_device)
                    y = batch.targets.reshape(2 * b, t).to(strategy.root_device)
                    out[lo:lo + b] = sequence_logps(module.logits(x), y, module._vocab_used)[0].view(b, 2).float()
        finally:
            net.train(was)
        every = strategy.all_gather(out) if world > 1 else out.unsqueeze(0)  # (world, per_rank, 2)
        ordered = every.transpose(0, 1).reshape(-1, 2)[:n]  # pair i = rank i % world, its (i // world)-th
        return ordered.cpu().numpy().astype(np.float32)

    # ------------------------------------------------------------------ the summary
    def summary(self) -> dict[str, Any]:
        """summary.json `objective`: what was optimized, against which reference, and the last step's
        figures (mean over the data-parallel ranks); the validation's are in `validation`."""
        out: dict[str, Any] = {"name": str(self.objective.name), "reference": self.mode,
                               **{k: v for k, v in self.objective.items() if k not in ("name", "reference")}}
        if self.precomputed:
            out["reference_log_probs"] = dict(self.precomputed)
        if self.last is not None:
            out["last_step"] = {k: round(float(v), 6) for k, v in zip(LOGGED, self.last, strict=True)}
        return out


def _match_dtype(copy: torch.nn.Module, policy: torch.nn.Module) -> None:
    """A whole copy follows the policy's dtype (DeepSpeed casts its engine's module to bf16);
    FSDP2 shards both alike and casts in its mixed-precision policy."""
    from torch.distributed.tensor import DTensor

    first = next(policy.parameters(), None)
    if first is not None and not isinstance(first, DTensor):
        copy.to(dtype=first.dtype)
