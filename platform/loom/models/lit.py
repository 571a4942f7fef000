"""The LightningModules Loom builds from `model=...`.

Every one keeps the trained network as `self.model` (the plain nn.Module whose state_dict is
the run's final weights, and what FSDP/TP shard), declares `sharding_units` (the module
classes FSDP shards as units) and takes Loom's optimizer and schedule (loom.optim), and reads
the data's one declared batch type, `loom.data.batch.Batch`, by field. A user's own
LightningModule (`model=custom`) is used as it is (it receives the same Batch; `x, y = batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.utilities import GradClipAlgorithmType
from torch import nn

from loom.data.batch import IGNORE_INDEX, Batch
from loom.models.context_parallel import local_loss, whole_of
from loom.models.init import NamedInit, ResetParametersInit, meta_capable
from loom.optim.build import build_optimizer, sync_schedule

# model.* keys that configure Loom, not the network's constructor
CONFIG_ONLY_KEYS = ("name", "init_from", "init_from_fingerprint", "vocab_used", "lora")


def network_kwargs(model_cfg: DictConfig) -> dict:
    """The constructor arguments of Loom's own networks from `cfg.model`."""
    m = OmegaConf.to_container(model_cfg)
    return {k: v for k, v in m.items() if k not in CONFIG_ONLY_KEYS}


class LoomModule(pl.LightningModule):
    """Subclasses say how to build the network (`build_model`) and how to initialize it by
    parameter name (`initializer`); `configure_model` builds it (loom.models.construct)."""

    sharding_units: tuple[type, ...] = ()
    tensor_parallel_plan: dict[type, dict[str, str]] = {}
    pair_step: Any = None  # a pair objective's step (loom.objectives.step.PairStep), handed over by the worker
    # float8 (loom.float8.convert.Float8Conversion), handed over by the worker: `convert` swaps the built
    # network's Linear layers before it is parallelized; `after_optimizer_step` follows every step
    model_converter: Any = None

    def __init__(self, cfg: DictConfig, make_model: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        self.cfg, self._make_model = cfg, make_model
        self.optim_cfg, self.max_steps = cfg.optim, cfg.trainer.max_steps
        self.build_peak_rss_gb: float | None = None
        self._built = False
        self._vocab_used: int | None = (cfg.get("model") or {}).get("vocab_used")  # read once, not every step
        self._val_sums = TokenWeightedLoss()  # several validation sources: their token-weighted val/loss

    def build_model(self) -> nn.Module:
        """A new network (called on the meta device first, then for real where needed)."""
        if self._make_model is None:
            raise NotImplementedError(f"{type(self).__name__} gives no model factory")
        return self._make_model()

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        """(how to initialize each parameter by name, None) or (None, why the model cannot be
        built on the meta device). Default: each leaf's own reset_parameters()."""
        why = meta_capable(meta_model)
        return (None, why) if why else (ResetParametersInit(int(self.cfg.seed), meta_model), None)

    def configure_model(self) -> None:
        """Lightning calls this once the strategy exists, inside the strategy's init contexts
        (ZeRO-3: deepspeed.zero.Init), before the optimizers are built. Called without a
        trainer (tests, tools), it builds the plain model on the CPU."""
        if self._built:
            return
        from loom.models.construct import construct

        strategy = self._trainer.strategy if self._trainer is not None else None
        construct(self, strategy)
        if self.pair_step is not None and self.pair_step.mode == "online":
            self.pair_step.build_online(self, strategy)  # the frozen reference, built like the policy
        self._built = True

    def on_fit_start(self) -> None:
        """A pair objective's reference log-probs, precomputed before the first step where asked."""
        if self.pair_step is not None:
            self.pair_step.before_training(self, self.trainer)

    def logits(self, x: torch.Tensor, network: nn.Module | None = None) -> torch.Tensor:
        """The logits of `network` (default: the trained model) for token ids `x`: a pair objective
        scores its reference with it too."""
        return (network if network is not None else self.model)(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)

    def _loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def _lm_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A causal LM's loss (the pipeline's loss_fn too), over the tokenizer's ids only."""
        return _lm_loss(logits, y, self._vocab_used)

    def _pipeline_batch(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and targets the pipeline's first and last stages take: this rank's slice of
        each sequence under context parallelism (the network's `context`)."""
        cp = getattr(self.model, "context", None)
        if cp is None:
            return batch.inputs, batch.targets
        return cp.local(batch.inputs), cp.local(batch.targets)

    def _pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss_fn: `_lm_loss`, or under context parallelism the mean of the cp
        ranks' slice means (`whole_of`): the whole mean, as every slice trains as many targets
        (pipelines carry no positions or loss scale: validation refuses both)."""
        loss = self._lm_loss(logits, y)
        cp = getattr(self.model, "context", None)
        return loss if cp is None else whole_of(loss / cp.size, cp)

    def _pipeline(self):
        """The strategy's pipeline (strategy=pp | nd with pp > 1), else None."""
        return getattr(self.trainer.strategy, "pipeline", None) if self._trainer is not None else None

    def _step_loss(self, batch: Batch) -> torch.Tensor:
        """The loss the batch declares: preference pairs go to the run's pair objective (a batch of
        another type, a user module's own, is its `_loss`'s)."""
        if not getattr(batch, "pairs", False):
            return self._loss(batch)
        if self.pair_step is None:
            raise RuntimeError("a batch of preference pairs needs a pair objective (objective=dpo|ipo|simpo|reward)")
        return self.pair_step.loss(self, batch)

    def context_parallel(self, mesh: Any, style: str) -> None:
        """Split each sequence over the mesh's cp ranks (`strategy.cp`): the network and its attention
        modules get this rank's ContextShard (loom.models.context_parallel); a family whose attention
        is not Loom's overrides this."""
        from loom.models.context_parallel import apply_context_parallel

        apply_context_parallel(self.model, mesh, style)

    def with_auxiliary(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss plus what the family adds to every step's (a mixture of experts' balance loss)."""
        return loss

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        pipe = self._pipeline()
        return self._step_loss(batch) if pipe is None else self._pipeline_step(pipe, batch)

    def _pipeline_step(self, pipe, batch: Batch) -> torch.Tensor:
        """Manual optimization: the schedule runs every microbatch's forward and backward, then
        clip by the norm across stages, step the optimizer and the lr schedule. (Checks refuse
        positions and a loss scale under pipeline parallelism: the stages see tokens only.)"""
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = pipe.run(self.model, self._pipeline_loss, *self._pipeline_batch(batch))
        clip = self.cfg.trainer.gradient_clip_val
        if clip:
            pipe.clip(list(self.model.parameters()), float(clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Lightning's step, then the gradients freed at once. Lightning zeroes them in the next
        step's closure, after that step's forward, so every forward stored its activations beside
        the last step's gradients (gpt_1b under fsdp on an H100 peaked at the plan's sum of the
        two). Freed here, as torchtitan's loop does before forward, a step's peak holds the larger
        of activations and gradients (`loom.plan.memory.MemoryEstimate`). DeepSpeed's engine keeps
        its own gradient buffers and zeroes them in its step: left to it."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if not self.trainer.strategy.handles_gradient_accumulation:
            optimizer.zero_grad(set_to_none=True)
        if self.model_converter is not None:  # float8 all-gather's weight scales for the next step
            self.model_converter.after_optimizer_step(self.model)

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        pipe = self._pipeline()
        loss = (self._step_loss(batch) if pipe is None
                else pipe.run(self.model, self._pipeline_loss, *self._pipeline_batch(batch), train=False))
        names = self._val_names()
        if len(names) <= 1:
            self.log("val/loss", loss, sync_dist=True, prog_bar=False)
            return loss
        self.log(f"val/loss/{names[dataloader_idx]}", loss, sync_dist=True, add_dataloader_idx=False)
        self._val_sums.add(loss, batch.targets)
        return loss

    def _val_names(self) -> list[str]:
        """One name per validation source (the datamodule's `val_names`); one or none: a single loader."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return list(getattr(dm, "val_names", None) or [])

    def on_validation_epoch_start(self) -> None:
        self._val_sums = TokenWeightedLoss()

    def on_validation_epoch_end(self) -> None:
        """Several sources: the overall val/loss over all of them, weighted by target tokens
        (each source's val/loss/<name> is its own mean): summed over ranks, then divided."""
        if len(self._val_names()) <= 1:  # the same answer on every rank: all reduce, or none
            return
        sums = self._val_sums
        local = (torch.stack([sums.total, sums.count]) if sums.count is not None
                 else torch.zeros(2, dtype=torch.float64, device=self.device))
        total = self.trainer.strategy.reduce(local, reduce_op="sum")
        self.log("val/loss", total[0] / total[1].clamp_min(1), sync_dist=True)
        self._val_sums = TokenWeightedLoss()

    def configure_optimizers(self):
        trainer = self._trainer
        scaled_clipping = bool(trainer and trainer.precision == "16-mixed" and trainer.gradient_clip_val)
        return build_optimizer(list(self.model.named_parameters()), self.optim_cfg, self.max_steps,
                               scaled_clipping)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's autocast plugin refuses to clip for any optimizer that unscales inside its
        step (fused AdamW), a guard written for fp16's loss scaler. bf16 autocast has no scaler:
        the gradients are already true, so clip them as the 32-bit path does (the strategy's own
        clip_grad_by_norm included). fp16 with clipping never gets a fused optimizer (optim.build)."""
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and getattr(plugin, "scaler", False) is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_start(self) -> None:
        """Resumed with a raised trainer.max_steps, the restored learning rate is the old
        schedule's: set the schedule's value for this step now (identical on a plain resume)."""
        for config in self.trainer.lr_scheduler_configs:
            sync_schedule(config.scheduler)


class TokenWeightedLoss:
    """Sums of (batch mean loss x its target tokens) and of target tokens (targets != -100,
    the ones cross_entropy averages over), for a mean over batches weighted by tokens."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, y: torch.Tensor) -> None:
        n = (y != IGNORE_INDEX).sum().to(torch.float64)
        part = torch.where(n > 0, loss.detach().to(torch.float64) * n, 0.0)  # an all-ignored batch: NaN mean, no weight
        self.total = part if self.total is None else self.total + part
        self.count = n if self.count is None else self.count + n


def _lm_loss(logits: torch.Tensor, y: torch.Tensor, used: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy over the first `used` logits (a vocabulary padded past the
    tokenizer's, models.checks.size_vocab_to_tokenizer: the padding never enters the softmax,
    so the loss is the unpadded model's)."""
    if used is not None and used < logits.shape[-1]:
        logits = logits[..., :used]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def batch_loss(logits: torch.Tensor, batch: Batch, used: int | None = None) -> torch.Tensor:
    """The loss a token batch declares: with a `loss_scale` (chat), the global batch's token mean;
    else the mean over this batch's trained targets."""
    if batch.loss_scale is not None:
        return _global_token_loss(logits, batch, used)
    return _lm_loss(logits, batch.targets, used)


def _global_token_loss(logits: torch.Tensor, batch: Batch, used: int | None = None) -> torch.Tensor:
    """Chat data's loss (loom.data.options.chat.samples): the summed cross-entropy of the trained targets
    times the sampler's `loss_scale`, so that the mean over micro batches and ranks is the mean over
    the global batch's trained tokens; without a scale (validation), this batch's token mean."""
    if used is not None and used < logits.shape[-1]:
        logits = logits[..., :used]
    y = batch.targets
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum")
    scale = batch.loss_scale.reshape(-1)[0]
    own_mean = total / (y != IGNORE_INDEX).sum().clamp_min(1)
    return torch.where(scale.isnan(), own_mean, total * scale.nan_to_num(0.0))


class DecoderModule(LoomModule):
    """A causal LM written in Loom (a family's `network`, built from `cfg.model`'s fields):
    subclasses name the network, its sharding units, tensor-parallel plan and init rule."""

    network: type[nn.Module]

    def build_model(self) -> nn.Module:
        return self.network(**network_kwargs(self.cfg.model))

    def _loss(self, batch: Batch) -> torch.Tensor:
        """Under dataset.packing=documents the batch's positions restart at each document start
        (the network's document mask), and its targets are already -100 where one would cross
        into the next document; chat data's batch carries its loss scale (`batch_loss`)."""
        args = (batch.inputs,) if batch.positions is None else (batch.inputs, batch.positions)
        logits = self.model(*args)
        cp = getattr(self.model, "context", None)  # strategy.cp: logits of this rank's slice
        if cp is not None:
            return local_loss(logits, batch.targets, cp, batch.loss_scale, self._vocab_used)
        return batch_loss(logits, batch, self._vocab_used)


class ClassifierModule(LoomModule):
    """Cross-entropy classification, `model=mlp`; logs val/acc next to val/loss."""

    def _loss(self, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(self.model(batch.inputs).float(), batch.targets)

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        y = batch.targets
        logits = self.model(batch.inputs).float()
        loss = F.cross_entropy(logits, y)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)
        return loss


class WrappedModule(LoomModule):
    """A user's nn.Module + a loss (`model=custom` with a plain module): loss(model(x), y).
    Outputs with one more dimension than the targets beyond (batch, classes), e.g. a language
    model's (B, T, V) logits for (B, T) targets, are flattened to (B*T, V) first."""

    def __init__(self, cfg: DictConfig, make_model: Callable[[], nn.Module], loss: nn.Module | None,
                 prebuilt: bool = False) -> None:
        super().__init__(cfg, make_model)
        self._prebuilt = prebuilt
        self.loss_fn = loss if loss is not None else nn.CrossEntropyLoss()

    def initializer(self, meta_model: nn.Module) -> tuple[NamedInit | None, str | None]:
        if self._prebuilt:
            return None, "a factory function built it"
        return super().initializer(meta_model)

    def build_model(self) -> nn.Module:
        model = super().build_model()
        self.sharding_units = tuple(getattr(model, "sharding_units", ()))
        return model

    def _loss(self, batch: Batch) -> torch.Tensor:
        y = batch.targets
        out = self.model(batch.inputs)
        if out.dim() > 2 and out.dim() == y.dim() + 1:
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return self.loss_fn(out.float() if out.is_floating_point() else out, y)
