"""`strategy=pp` (and `nd` with pp > 1): a model's layers split into pipeline stages
(torch.distributed.pipelining), inside Lightning's ModelParallelStrategy.

Which modules a stage holds is the network's to say (`pipeline_split`, the hook in
loom.models.pipeline_split: Loom's GPT and Llama declare one): its layers split evenly by index,
the embeddings with the first stage, the final norm and head with the last, everything else
(Llama's rotary embedding) on every stage. Each rank keeps `module.model` as the full network
minus the other stages' modules (torchtitan's way): the layers it holds stay under their own
names (`blocks.3.attn.qkv.weight`, `model.layers.3.mlp.up_proj.weight`), so name-seeded init,
DCP checkpoints and final weights use the single-device names. Its stages are thin
`_StageChunk` views over those modules (not registered, so no parameter gets a second name)
that run the network's own `embed`, `layer_inputs` and `head` steps, driven by the schedule of
`strategy.pp_schedule`. The LightningModule runs with manual optimization: the schedule's
`step()` runs forward and backward over the microbatches, the last stage computes the loss,
then gradients are clipped by the norm across stages, and the optimizer and the lr schedule
step. The loss is broadcast over the pipeline group so every rank (rank 0's metrics included)
sees the last stage's value.

With data parallelism (`nd`: dp_replicate x dp_shard > 1) and tensor parallelism, the stages
are built first, then the TP plan is applied to their layers and FSDP2 shards each stage
module over the data-parallel ranks (torchtitan's order); the mesh is (data_parallel,
pipeline, tensor_parallel), data_parallel being (replicate, shard) flattened under HSDP.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models import layer_count
from loom.strategies.degrees import PP_SCHEDULES, microbatches_of

log = logging.getLogger("loom")


def stage_ids(pp_rank: int, pp: int, per_rank: int, style: str = "loop") -> list[int]:
    """The pipeline stages of pipeline rank `pp_rank`: looped (r, r + pp, ...) or V-shaped."""
    if per_rank == 1:
        return [pp_rank]
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def stage_blocks(stage: int, n_stages: int, n_layer: int) -> range:
    """The layer indices of `stage`: an even split, later stages taking the remainder's layers."""
    return range(stage * n_layer // n_stages, (stage + 1) * n_layer // n_stages)


def _style(schedule: str) -> str:
    return "v" if "zbv" in schedule else "loop"


def _guard_local_bwd(stage) -> None:
    """Under V placement torch (2.13) hands gradients between a rank's two adjacent stages
    locally, even in `eval()` (no backward), where the stage refuses ("can't steal_bwd_input if
    this stage doesn't have backward"): skip the hand-over when there is no backward."""
    get, put = stage.get_local_bwd_output, stage.set_local_bwd_input
    stage.get_local_bwd_output = lambda mb: get(mb) if stage.has_backward else ()
    stage.set_local_bwd_input = lambda grads, mb: put(grads, mb) if stage.has_backward else None


def _chunk_class():
    from torch import nn

    class _StageChunk(nn.Module):
        """One pipeline stage over modules the network owns: its first-stage modules (first
        stage), its layers, its last-stage modules (last stage). The modules are registered
        here so that FSDP2 can shard the stage as a root; the network itself is not (its
        parameters would get a second name), and runs the steps of its `pipeline_split`."""

        def __init__(self, net, layers: list, first: bool, last: bool) -> None:
            super().__init__()
            split = net.pipeline_split
            object.__setattr__(self, "net", net)  # plain attribute: not a submodule
            self.layers = nn.ModuleList(layers)
            self.is_first, self.is_last = first, last
            ends = (split.first if first else ()) + (split.last if last else ())
            self.ends = nn.ModuleDict({p.replace(".", "_"): m for p in ends
                                       if (m := get_path(net, p)) is not None})

        def forward(self, x):
            net = self.net
            if self.is_first:
                x = net.embed(x)
            extra = net.layer_inputs(x)
            for layer in self.layers:
                x = layer(x, *extra)
            return net.head(x) if self.is_last else x

    return _StageChunk


def get_path(net, path: str):
    """The module at a dotted attribute path ("model.embed_tokens"), None where it is None."""
    for name in path.split("."):
        net = getattr(net, name) if net is not None else None
    return net


def set_path(net, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(net, parent) if parent else net, name, value)


def split_stages(net, stages: list[int], n_stages: int) -> list:
    """Cut `net` down to `stages` of `n_stages` (in place): the other stages' layers and end
    modules dropped (kept layers keep their index as name), and one `_StageChunk` per stage.
    `net` must declare a `pipeline_split` (loom.models.pipeline_split)."""
    from torch import nn

    split = getattr(net, "pipeline_split", None)
    if split is None:
        raise ValueError(f"{type(net).__name__} declares no pipeline_split: it cannot be split into stages")
    layers = list(get_path(net, split.layers))
    n_layer = len(layers)
    keep = {b for st in stages for b in stage_blocks(st, n_stages, n_layer)}
    set_path(net, split.layers, nn.ModuleDict({str(i): b for i, b in enumerate(layers) if i in keep}))
    for path in (split.first if 0 not in stages else ()) + (split.last if n_stages - 1 not in stages else ()):
        set_path(net, path, None)
    kept = get_path(net, split.layers)
    chunk = _chunk_class()
    return [chunk(net, [kept[str(i)] for i in stage_blocks(st, n_stages, n_layer)],
                  first=st == 0, last=st == n_stages - 1) for st in stages]


class Pipeline:
    """This rank's stages of the network and the schedule that drives them (built at first use,
    once the parameters are materialized on the device)."""

    def __init__(self, cfg: DictConfig, layout: ParallelLayout, mesh, device) -> None:
        s = cfg.strategy
        self.name = str(s.pp_schedule)
        self.per_rank = PP_SCHEDULES[self.name].stages_per_rank
        self.pp, self.n_stages = layout.pp, layout.pp * self.per_rank
        self.group = mesh["pipeline"].get_group()
        self.pp_rank = mesh["pipeline"].get_local_rank()
        self.stages = stage_ids(self.pp_rank, self.pp, self.per_rank, _style(self.name))
        self.microbatches = microbatches_of(s, layout.pp)
        self.layers = layer_count(cfg)
        self.device, self.layout = device, layout
        self.schedule: Any = None
        self.chunks: list = []
        self.split: Any = None  # the network's PipelineSplit, once pruned

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stages

    def owner_pp_rank(self, stage: int) -> int:
        for r in range(self.pp):
            if stage in stage_ids(r, self.pp, self.per_rank, _style(self.name)):
                return r
        raise ValueError(stage)

    def local_blocks(self) -> list[int]:
        return [b for st in self.stages for b in stage_blocks(st, self.n_stages, self.layers)]

    def prune(self, module) -> None:
        """Drop the modules of the other ranks' stages (kept layers keep their names) and make
        this rank's stage modules (`chunks`), which FSDP2 may then shard as roots: the module's
        own `pipeline_chunks` where it has one (a transformers decoder's plan), else the
        network's `pipeline_split`."""
        net = module.model
        own = getattr(module, "pipeline_chunks", None)
        self.chunks = own(net, self.stages, self.n_stages) if own else split_stages(net, self.stages, self.n_stages)
        self.split = net.pipeline_split

    def _build(self, loss_fn) -> None:
        """The PipelineStages over the chunks (an FSDP2 chunk gets its gradient reduction from
        the stage: no sync until the last microbatch's backward) and the schedule."""
        from torch.distributed.pipelining import PipelineStage, schedules

        stages = [PipelineStage(mod, st, self.n_stages, self.device, group=self.group)
                  for st, mod in zip(self.stages, self.chunks, strict=True)]
        if _style(self.name) == "v":
            for stage in stages:
                _guard_local_bwd(stage)
        cls = getattr(schedules, PP_SCHEDULES[self.name].torch_class)
        self.schedule = (cls(stages[0], self.microbatches, loss_fn=loss_fn) if self.per_rank == 1
                         else cls(stages, self.microbatches, loss_fn=loss_fn))
        log.info(f"pipeline: rank {self.pp_rank}/{self.pp} runs stages {self.stages} of {self.n_stages} "
                 f"(layers {self.local_blocks()}), {self.name}, {self.microbatches} microbatches")

    def run(self, net, loss_fn, x, y, train: bool = True):
        """One pass over the batch (forward + backward when `train`); the mean microbatch loss,
        the same on every rank of the pipeline group."""
        import torch
        import torch.distributed as dist

        if self.schedule is None:
            self._build(loss_fn)
        losses: list = []
        args = (x,) if self.has_first else ()
        kw = {"target": y, "losses": losses} if self.has_last else {}
        if train:
            self.schedule.step(*args, **kw)
        else:
            self.schedule.eval(*args, **kw)
        # fp32 on every rank (bf16-true makes bf16 the default dtype): gloo refuses mismatched sizes
        loss = (torch.stack([t.detach().float() for t in losses]).mean() if losses
                else torch.zeros((), device=self.device, dtype=torch.float32))
        src = self.owner_pp_rank(self.n_stages - 1)
        dist.broadcast(loss, group=self.group, group_src=src)
        return loss

    def clip(self, parameters, max_norm: float) -> None:
        """clip_grad_norm_ by the norm across every mesh dimension: each stage's squared norm
        (DTensor gradients reduced over their data-parallel and tensor-parallel dims), summed
        over the pipeline group."""
        import torch
        import torch.distributed as dist

        from loom.strategies.model_parallel import scale_grads, squared_norm

        grads = [p.grad for p in parameters if p.grad is not None]
        sq = squared_norm(grads) if grads else torch.zeros((), device=self.device, dtype=torch.float32)
        dist.all_reduce(sq, group=self.group)
        scale_grads(grads, torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0))


def shard_stages(module, chunks: list, mesh, lay: ParallelLayout, s: DictConfig) -> None:
    """FSDP2 over the data-parallel ranks of each stage: its sharding units, then the stage
    module as the root (with its embeddings or norm + head), so that PipelineStage sees an
    FSDPModule and reduces gradients once, after the last microbatch's backward. Mixed
    precision stays with Lightning (autocast) under pipelining: no FSDP2 policy here."""
    from loom.strategies.model_parallel import _unit_classes, shard_roots

    dp_mesh = mesh["replicate", "shard"] if lay.dp_replicate > 1 else mesh["data_parallel"]
    shard_roots(chunks, _unit_classes(module, s.get("shard_units")), dp_mesh,
                bool(s.get("reshard_after_forward", True)))


def _pipeline_strategy_class():
    from loom.strategies.model_parallel import _model_parallel_strategy_class

    base = _model_parallel_strategy_class()

    class LoomPipelineStrategy(base):
        """ModelParallelStrategy (its DCP checkpoints, sampler over the data-parallel dim) on a
        (data_parallel, pipeline, tensor_parallel) mesh, the rank order of `loom.layout`."""

        pipeline: Pipeline | None = None

        def setup_environment(self) -> None:
            self._setup_distributed()
            from loom.strategies.mesh import pipeline_mesh

            self._device_mesh = pipeline_mesh(self.root_device.type, self.loom_layout)
            self.lightning_module._device_mesh = self._device_mesh
            self.pipeline = Pipeline(self.loom_cfg, self.loom_layout, self._device_mesh, self.root_device)

        def setup(self, trainer) -> None:
            super(base, self).setup(trainer)  # ModelParallelStrategy's, not Loom's clip hook (manual optimization)

        def parallelize(self, module) -> None:
            """Stages first, then TP on their layers, then FSDP2 on each stage (torchtitan's order)."""
            from loom.strategies.model_parallel import _apply_tensor_parallel

            self.pipeline.prune(module)
            lay = self.loom_layout
            if lay.tp > 1:
                _apply_tensor_parallel(module, self._device_mesh["tensor_parallel"])
            if lay.cp > 1:
                module.context_parallel(self._device_mesh["cp"], str(lay.cp_style))
            if lay.dp * lay.cp > 1 or lay.tp > 1:
                # Under TP alone too (a 1-rank data-parallel mesh): the TP plan leaves embeddings and
                # norms plain tensors beside the blocks' DTensors, and the fused/foreach optimizer
                # kernels refuse a mix ("got mixed torch.Tensor and DTensor"); fsdp_tp does the same.
                shard_stages(module, self.pipeline.chunks, self._device_mesh, lay, self.loom_cfg.strategy)

        def optimizer_state(self, optimizer) -> dict:
            """The optimizer's DCP state with its param groups flattened per parameter
            (`param_groups.<fqn>.lr`), torchtitan's way under pipelining. Unflattened, a group
            is saved as `param_groups.<i>.{lr, params, ...}`: the same keys on every stage, and
            DCP keeps one rank's copy of a non-tensor entry, so another stage got back groups
            that list none of its parameters (and lost their hyper-parameters: KeyError 'lr')."""
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            opt = getattr(optimizer, "_optimizer", optimizer)
            return get_optimizer_state_dict(self.model, opt, options=self._optim_options())

        def _optim_options(self):
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            return StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=not self.async_checkpoints)

        def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
            """Lightning's sharded (DCP) load, which looks for DTensor parameters to find the
            model: a stage's parameters are plain tensors, so the same steps are taken here.
            Each rank reads its own stage's entries (their names are the single-device ones),
            optimizer param groups included (flattened per parameter, `optimizer_state`)."""
            from pathlib import Path

            import torch
            from lightning_fabric.strategies.fsdp import _distributed_checkpoint_load
            from lightning_fabric.utilities.load import _METADATA_FILENAME
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
                set_optimizer_state_dict,
            )

            path = Path(self.broadcast(checkpoint_path))
            module = self.model
            state = {"state_dict": get_model_state_dict(module)}
            _distributed_checkpoint_load(state, path)
            module.load_state_dict(state["state_dict"], strict=True)
            for i, optim in enumerate(self.optimizers):
                key, opt = f"optimizer_{i}", getattr(optim, "_optimizer", optim)
                optim_state = {key: get_optimizer_state_dict(module, opt, options=self._optim_options())}
                _distributed_checkpoint_load(optim_state, path)
                set_optimizer_state_dict(module, opt, optim_state_dict=optim_state[key],
                                         options=self._optim_options())
            meta = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
            meta.pop("state_dict", None)
            return meta

        # ------------------------------------------------------------ final weights
        def model_state_entries(self, trainer, module) -> list:
            """Every entry of the whole network, in its own order: this rank's tensors, and meta
            tensors (shape and dtype only) for the other stages' ones."""
            from loom.models.init import params_on_meta

            with params_on_meta():
                full = module.build_model()
            local = module.model.state_dict(keep_vars=True)
            self._owners = {}
            out = []
            for key, meta in full.state_dict(keep_vars=True).items():
                t = local.get(key, meta)
                self._owners[id(t)] = self._owner_rank(key)
                out.append((key, t))
            return out

        def _owner_rank(self, key: str) -> int:
            p = self.pipeline

            def stage_of_layer(layer: int) -> int:
                return next(s for s in range(p.n_stages) if layer in stage_blocks(s, p.n_stages, p.layers))

            stage = p.split.stage_of(key, stage_of_layer, p.n_stages)
            lay = self.loom_layout  # the (dp, pp, cp, tp) grid's rank at dp = cp = tp = 0
            return p.owner_pp_rank(stage) * lay.cp * lay.tp

        def gather_full_tensor(self, trainer, t):
            """The entry whole on rank 0: its stage's ranks gather a DTensor (FSDP2 / TP), then
            the stage's data- and tensor-parallel rank 0 sends it to global rank 0."""
            import torch
            import torch.distributed as dist
            from torch.distributed.tensor import DTensor

            owner = self._owners[id(t)]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if owner == 0:
                return full.detach().cpu() if trainer.is_global_zero else None
            if self.global_rank == owner:
                dist.send(full.detach().contiguous(), dst=0)
            elif trainer.is_global_zero:
                buf = torch.empty(t.shape, dtype=t.dtype, device=self.root_device)
                dist.recv(buf, src=owner)
                return buf.cpu()
            return None

    return LoomPipelineStrategy


def build_mesh(cfg: DictConfig, layout: ParallelLayout):
    """fsdp, fsdp_tp, pp and nd, one implementation of the N-D mesh: the pipeline above when the
    layout has pp > 1, FSDP2 x TP (`model_parallel`, which this one extends) otherwise. The
    presets differ only in the degrees their layout gives."""
    if layout.pp == 1:
        from loom.strategies import model_parallel

        return model_parallel.build(cfg, layout)
    return _pipeline_strategy_class()(
        cfg, layout, data_parallel_size=layout.dp * layout.cp, tensor_parallel_size=layout.tp * layout.pp,
        save_distributed_checkpoint=True, process_group_backend=cfg.hardware.backend)
