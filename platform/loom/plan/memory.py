"""Memory and communication per device: the arithmetic of `loom plan` (no torch import).

Memory per device follows the ZeRO paper (Rajbhandari et al., 2020, section 3 and fig. 1):
with mixed-precision Adam, DDP holds 16 bytes per parameter, stage 1 4 + 12/N, stage 2
2 + 14/N, stage 3 (and FSDP, which shards the same three states) 16/N. In fp32 (CPU) the
same 16 bytes split 4 params / 4 grads / 8 optimizer states.

Which split applies depends on who implements the precision. DeepSpeed (zero*) keeps 16-bit
params and grads plus an fp32 master copy inside the optimizer: the paper's 2 / 2 / 12; in
fp32 it still clones the fp32 partition it steps, so 4 / 4 / 12 (measured on CPU).
`bf16-mixed` for ddp is Lightning's autocast and for fsdp FSDP2's MixedPrecisionPolicy (no
autocast): either way the stored parameters and gradients stay fp32 and only the compute
(and FSDP's all-gathers) is 16-bit: 4 / 4 / 8. The totals agree; the split and the bytes on
the wire differ (`wire_bytes`). `bf16-true` casts everything, the Adam moments too: 2 / 2 / 4.
fsdp_tp: the Block linears are split over tp x dp ranks; what tensor parallelism leaves
replicated (embeddings, head, norms, row-parallel biases) is sharded over dp only.
Activations follow Korthikanti et al. 2022 and `trainer.activation_checkpointing`
(`activation_bytes`); the host memory of the model's build is `build_host_bytes`.

Written by hand (not DeepSpeed's `estimate_zero*_model_states_mem_needs`) because the plan
must answer in well under a second, before torch, Lightning or DeepSpeed are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from omegaconf import DictConfig, OmegaConf

from loom import strategies
from loom.compose import conf_dir
from loom.data import rows_per_sample
from loom.layout import ParallelLayout
from loom.models import MODELS, layer_count, model_parts, model_width, trainable_params, vocab_size
from loom.models.heads import head_of
from loom.optim import state_slots
from loom.plan.context import collective, context_bytes, local_seq_len, state_shards
from loom.plan.experts import all_to_all_bytes, expert_group_fraction, expert_share
from loom.strategies.deepspeed_config import resolved_deepspeed_config, zero_stage

GB = 1e9
# Share of a device's memory the plan lets a run use: the CUDA context, NCCL buffers and the
# caching allocator's fragmentation take the rest. Host: the OS and the Python/torch runtime.
GPU_USABLE = 0.90
HOST_USABLE = 0.80
# Host memory of one rank's Python + torch + Lightning runtime before its model is built.
# CPU: measured, 0.44 GB peak RSS after `import torch, pytorch_lightning` (torch 2.13 CPU
# build); a whole gpt_tiny rank (gloo group, Lightning, data) peaks at 0.47-0.63 GB RSS in
# training (summary.json memory.peak_rss_gb_per_rank of single/ddp/fsdp/zero runs, 0.5M
# params), i.e. this runtime plus the states and activations the plan adds. GPU: assumed, the
# usual 2-3 GB RSS of a CUDA process once the CUDA context, cuBLAS/cuDNN/NCCL libraries and
# pinned staging buffers are loaded.
RUNTIME_HOST_BYTES = {"gpu": 2.5 * GB, "cpu": 0.5 * GB}


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    host_offload: float = 0.0    # optimizer (and params) moved to host memory
    runtime: float = 0.0         # CPU: the rank's own runtime, in the same (host) memory
    # Whether the gradients exist while forward stores the activations (`grads_beside_activations`);
    # False: the peak holds the larger of the two, not their sum.
    grads_in_forward: bool = True
    float8_cast: float = 0.0     # float8=...: the transient float8 weight copies (plan.float8.cast_bytes)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def step_bytes(self) -> float:
        """Gradients and activations at the step's peak: their sum, or the larger of the two when
        the gradients are freed after each optimizer step and grow in backward as the activations
        are freed."""
        return self.grads + self.activations if self.grads_in_forward else max(self.grads, self.activations)

    @property
    def total(self) -> float:
        return self.params + self.optimizer + self.step_bytes + self.runtime + self.float8_cast


def per_param_bytes(strategy: str, precision: str, optim: DictConfig | None = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter for a strategy at a precision, with the
    optimizer's state following `optim` (None: AdamW): AdamW m and v, SGD its momentum (none
    without), each a tensor of the parameter's size in the parameter's dtype."""
    slots = state_slots(optim)
    if zero_stage(strategy) is not None:
        # fp32 master partition (a copy even when the model is fp32) + fp32 optimizer state
        return (4.0, 4.0, 4.0 + 4.0 * slots) if precision == "32-true" else (2.0, 2.0, 4.0 + 4.0 * slots)
    if precision == "bf16-true":
        return 2.0, 2.0, 2.0 * slots
    return 4.0, 4.0, 4.0 * slots  # fp32, autocast, FSDP2 policy: fp32 params, grads and state


def wire_bytes(cfg: DictConfig, name: str) -> tuple[float, float]:
    """(gathered parameter, reduced gradient) bytes per element on the wire.

    zero*: 16-bit parameters are gathered; gradients travel in DeepSpeed's resolved
    `communication_data_type` (Loom's default fp32). fsdp: FSDP2 gathers in the policy's
    param dtype and reduces in fp32. ddp: fp32 gradients unless a compression hook halves them.
    """
    hw, s = cfg.hardware, cfg.strategy
    half = hw.precision != "32-true"
    if zero_stage(name) is not None:
        comm = (resolved_deepspeed_config(cfg, strategies.layout_of(cfg)) if name == s.name else {}).get("communication_data_type", "fp32")
        return (2.0 if half else 4.0), (4.0 if comm in ("fp32", "float32") else 2.0)
    grads = 2.0 if hw.precision == "bf16-true" else 4.0
    if name == s.name and s.get("comm_hook") in ("fp16_compress", "bf16_compress"):
        grads = 2.0
    return (2.0 if half else 4.0), grads


@cache
def offloads_optimizer(strategy: str) -> bool:
    """Whether a strategy option's yaml moves the optimizer states to the host by default."""
    path = conf_dir() / "strategy" / f"{strategy}.yaml"
    return bool(path.is_file() and OmegaConf.load(path).get("offload_optimizer", False))


def state_bytes(
    strategy: str,
    n_params: float,
    n_shards: int,
    mixed: bool,
    *,
    per_param: tuple[float, float, float] | None = None,
    offload_optimizer: bool | None = None,
    offload_params: bool = False,
    trainable: float | None = None,
) -> MemoryEstimate:
    """Params / grads / optimizer bytes per device for one strategy (activations excluded).

    `mixed` picks the ZeRO paper's 2/2/12 bytes per parameter (else fp32's 4/4/8) unless
    `per_param` gives the split. `n_shards` is the data-parallel size the states are
    partitioned over (ignored by single/ddp). Offload moves the optimizer states (and with
    `offload_params` the parameter shards) to host memory: `host_offload`. Which states a
    strategy partitions is its registry entry's `states`. `trainable`: the parameters that get
    gradients and optimizer state when not all do (LoRA's adapters; the frozen base has weights only).
    """
    P, N = float(n_params), max(1, int(n_shards))
    T = P if trainable is None else float(trainable)
    p, g, o = per_param or ((2.0, 2.0, 12.0) if mixed else (4.0, 4.0, 8.0))
    states = strategies.option(strategy).states
    mem = MemoryEstimate(
        p * P / (N if states == "all" else 1),
        g * T / (N if states in ("all", "optimizer+grads") else 1),
        o * T / (N if states != "none" else 1),
        0.0,
    )
    if offload_optimizer is None:
        offload_optimizer = offloads_optimizer(strategy)
    if offload_optimizer:
        mem.host_offload += mem.optimizer
        mem.optimizer = 0.0
    if offload_params and states == "all":
        mem.host_offload += mem.params
        mem.params = 0.0
    return mem


def layer_activation_bytes(s: int, b: int, h: int, tp: int, mixed: bool) -> float:
    """Activations one transformer layer stores for backward, per TP rank (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2: tensor
    parallelism without sequence parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in
    16-bit). Flash attention (SDPA) stores no s x s scores, so the 5*a*s/(h*t) term is
    dropped. The 10*s*b*h the TP ranks all repeat are the two LayerNorm inputs, the inputs
    of q/k/v and of the MLP's up projection, and the two dropout masks; only the 24*s*b*h
    inside attention and the MLP split over t. fp32 activations are twice the bytes."""
    return s * b * h * (10 + 24 / tp) * (1.0 if mixed else 2.0)


def activation_bytes(cfg: DictConfig, tp: int, mixed: bool, mode: str | None = None, cp: int = 1) -> float:
    """Stored activations of one micro batch per device, following activation checkpointing
    (`mode`, default `trainer.activation_checkpointing`), plus the logits at the loss.

    none: every layer stores its model family's `Parts.layer_activation_bytes` (GPT: Korthikanti's;
    Llama: measured; other models: `layer_activation_bytes`). full: each layer keeps only its input
    (2*s*b*h bytes in 16-bit, 4 in fp32; replicated across TP ranks without sequence
    parallelism: Korthikanti et al. 2022, section 4.3, "2sbhL"), plus one layer's full
    activations while it is recomputed in backward. selective (every other block,
    `loom.models.activation_checkpointing`): layers 0, 2, 4, ... input-only, the others
    full, plus one layer's recompute. The logits at the loss (~10*b*s*V bytes, below) are split
    over TP ranks (the head is column-parallel). Context parallelism (`cp`): every
    count is of the seq_len / cp tokens a rank holds (`plan.context`).
    """
    h, L = model_width(cfg), layer_count(cfg)
    if not h or not L:
        return 0.0
    mode = mode or cfg.trainer.get("activation_checkpointing", "none")
    b, s = cfg.dataset.batch_size * rows_per_sample(cfg.dataset), local_seq_len(cfg, cp)  # a pair: two rows
    parts = model_parts(cfg)
    full = parts.layer_activation_bytes(s * b, tp, mixed) if parts else layer_activation_bytes(s, b, h, tp, mixed)
    ckpt = {"none": 0, "selective": (L + 1) // 2, "full": L}[mode]  # layers that keep only their input
    kept_input = s * b * h * (2.0 if mixed else 4.0)
    stored = (L - ckpt) * full + ckpt * kept_input + (full if ckpt else 0.0)
    outputs = head_of(cfg.model).outputs or vocab_size(cfg)  # a score head writes one value per token
    # ~10 bytes per logit at the loss: the head's output, the fp32 log-softmax saved for backward and
    # the first gradient (bf16: 2 + 4 + 4 at the forward's peak). Measured by `loom plan --rehearse`:
    # llama3_8b at 16k tokens per rank, full recompute, bf16 (-5%; 8 bytes: -19%) and llama3_1b at 4k, fp32 (-4%)
    logits = 10 * b * s * outputs / tp
    return stored + logits


def tp_replicated_params(cfg: DictConfig) -> float:
    """Parameters tensor parallelism leaves whole on every TP rank, by the model's own TP plan
    (models.spec.Parts: embeddings, the head, the norms, row-parallel biases); 0 for a model
    Loom does not split."""
    from loom.models import model_parts

    parts = model_parts(cfg)
    return float(parts.tp_whole(layer_count(cfg), True, True)) if parts else 0.0


def memory_of(cfg: DictConfig, name: str, layout: ParallelLayout, params: float,
              ac: str | None = None) -> MemoryEstimate:
    """Per-device memory of strategy `name` (the run's own, or an alternative) at `layout`,
    with activation checkpointing `ac` (default: the run's own setting)."""
    hw, s = cfg.hardware, cfg.strategy
    own = name == s.name
    kw = dict(
        per_param=per_param_bytes(name, hw.precision, cfg.optim),
        offload_optimizer=bool(s.offload_optimizer) if own and "offload_optimizer" in s else None,
        offload_params=bool(s.get("offload_params", False)) if own else False,
    )
    mixed, tp, shards = hw.precision != "32-true", layout.tp, state_shards(layout)  # FSDP2: over dp_shard x cp
    kw["trainable"] = adapters = trainable_params(cfg) if tp == 1 else None  # LoRA (validation: tp=1); None: all
    params += adapters or 0  # the adapters' weights beside the frozen base's
    if tp > 1:  # TP-split Block weights over dp x tp; what TP replicates over dp only
        rep = min(params, tp_replicated_params(cfg))
        split = state_bytes(name, params - rep, shards * tp, mixed, **kw)
        whole = state_bytes(name, rep, shards, mixed, **kw)
        mem = MemoryEstimate(split.params + whole.params, split.grads + whole.grads,
                             split.optimizer + whole.optimizer, 0.0, split.host_offload + whole.host_offload)
    else:
        mem = state_bytes(name, params, shards, mixed, **kw)
    if own and s.get("reshard_after_forward") is False:
        # Params stay gathered from forward to backward: the whole (TP-local) model in
        # compute precision on every rank.
        mem.params += (2.0 if mixed else 4.0) * params / tp
    mem.activations = activation_bytes(cfg, tp, mixed, ac, layout.cp)
    mem.grads_in_forward = grads_beside_activations(cfg, name, layout)
    if hw.accelerator != "gpu":  # the device is the host: each process's runtime shares it
        mem.runtime = RUNTIME_HOST_BYTES["cpu"]
    return mem


def grads_beside_activations(cfg: DictConfig, name: str, layout: ParallelLayout) -> bool:
    """Whether a step's gradients exist during its forward. Loom frees them after each optimizer
    step (`LoomModule.optimizer_step`); they still are there under gradient accumulation (the
    earlier micro batches'), a pipeline (its microbatches'), or a strategy that keeps its own
    gradient buffers from step to step (DDP's buckets, DeepSpeed's partitions: `grad_buffers`)."""
    return (strategies.option(name).grad_buffers or layout.pp > 1
            or int(cfg.trainer.accumulate_grad_batches) > 1)


def comm_bytes(cfg: DictConfig, name: str, params: float, layout: ParallelLayout) -> dict[str, float]:
    """Bytes each device sends per optimizer step, by collective (ring algorithms: an
    all-reduce of S bytes moves 2(n-1)/n*S, a reduce-scatter or all-gather (n-1)/n*S).

    ddp / zero1 reduce once per step (Lightning skips the sync of accumulation steps);
    zero2 reduce-scatters every micro batch; zero3 / fsdp gather the params for forward and
    again for backward and reduce-scatter the grads every micro batch (1.5x ddp's volume).
    Tensor parallelism adds 4 activation all-reduces per layer per micro batch across the TP group;
    context parallelism shards over dp x cp and adds its exchanges around attention (`plan.context`);
    expert parallelism moves the experts' gathers to dp / ep ranks and adds its all-to-alls
    (`plan.experts`).
    """
    s = cfg.strategy
    own = name == s.name
    accum = cfg.trainer.accumulate_grad_batches
    p, g = wire_bytes(cfg, name)
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    group = (layout.dp_shard if layout.hybrid else layout.dp) * layout.cp  # the group states are reduced over
    frac = (group - 1) / group if group > 1 else 0.0
    local = params / (layout.tp * layout.pp)  # a pipeline rank reduces its stages' gradients only
    # gradients of the trainable parameters only (LoRA: the adapters'; zero1-2 gather those back)
    trained = (trainable_params(cfg) or params) / (layout.tp * layout.pp)
    states = strategies.option(name).states
    if states == "none":
        out["all_reduce"] = 2 * frac * g * trained
    elif states == "optimizer":
        out["reduce_scatter"] = frac * g * trained
        out["all_gather"] = frac * p * trained
    elif states == "optimizer+grads":
        out["reduce_scatter"] = accum * frac * g * trained
        out["all_gather"] = frac * p * trained
    else:
        gathers = 1 if own and s.get("reshard_after_forward") is False else 2
        experts, efrac = expert_share(cfg, layout), expert_group_fraction(layout)  # 0 without strategy.ep
        out["all_gather"] = accum * gathers * p * (frac * (local - experts) + efrac * experts)
        out["reduce_scatter"] = accum * g * (frac * (trained - experts) + efrac * experts)
        out["all_to_all"] = all_to_all_bytes(cfg, layout)
        if layout.hybrid:  # HSDP: all-reduce the grad shards across the replicas (on one node too)
            reps = layout.dp_replicate
            out["all_reduce"] = 2 * (reps - 1) / reps * g * trained / group
    out["all_reduce"] += tp_bytes(cfg, layout)
    if layout.cp > 1:
        out[collective(layout)] = context_bytes(cfg, layout)
    return out


def tp_bytes(cfg: DictConfig, layout: ParallelLayout) -> float:
    """Tensor parallelism's share of `comm_bytes`: 4 activation all-reduces per layer per micro
    batch across the TP group."""
    if layout.tp == 1:
        return 0.0
    tp = layout.tp
    act = 2.0 if cfg.hardware.precision != "32-true" else 4.0
    volume = cfg.dataset.batch_size * rows_per_sample(cfg.dataset) * local_seq_len(cfg, layout.cp) * model_width(cfg) * act
    return cfg.trainer.accumulate_grad_batches * 4 * (layer_count(cfg) / layout.pp) * 2 * (tp - 1) / tp * volume


def capacity(hw: DictConfig) -> tuple[float | None, str]:
    """Usable bytes per device (None: unknown) and where the number comes from."""
    if hw.accelerator == "gpu":
        if hw.device_memory_gb:
            return (GPU_USABLE * float(hw.device_memory_gb) * GB,
                    f"{GPU_USABLE:.0%} of {hw.device_name} {hw.device_memory_gb:g} GB")
        return None, f"{hw.device_name}: memory unknown (set hardware.device_memory_gb)"
    return (HOST_USABLE * float(hw.host_memory_gb) * GB / max(1, hw.devices),
            f"{HOST_USABLE:.0%} of host {hw.host_memory_gb:g} GB / {hw.devices} processes")


def host_ok(cfg: DictConfig, mem: MemoryEstimate) -> bool:
    hw = cfg.hardware
    if hw.accelerator != "gpu":
        return True  # on CPU, offload is the same memory: counted in the device total
    return mem.host_offload * hw.devices <= HOST_USABLE * hw.host_memory_gb * GB


def fits(cfg: DictConfig, mem: MemoryEstimate, capacity: float | None) -> bool:
    need = mem.total + (mem.host_offload if cfg.hardware.accelerator != "gpu" else 0.0)
    return (capacity is None or need <= capacity) and host_ok(cfg, mem)


def largest_param(cfg: DictConfig) -> float:
    """Elements of the model's largest single parameter: what initialization materializes
    whole (in fp32) before it is sharded (the model registry's `largest`; 0 when unknown)."""
    return MODELS[cfg.model.name].largest(cfg)


def built_on_host(cfg: DictConfig) -> bool:
    """Whether the model is built whole on the host instead of on the meta device: a user's
    module (`model=custom`: its own __init__ allocates) or a transformers model loaded from
    local weights (`from_pretrained`); the model registry's `built_on_host`."""
    return MODELS[cfg.model.name].built_on_host(cfg)


def build_host_bytes(cfg: DictConfig, name: str, layout: ParallelLayout, params: float) -> tuple[float, str]:
    """Peak host memory of one rank while its model is built, and how it is counted.

    Loom builds models on the meta device and materializes them shard by shard on the
    target device. GPU: the host holds the runtime (RUNTIME_HOST_BYTES) and the init
    temporary, one whole parameter in fp32 (`largest_param`). CPU: the host is the device,
    so the runtime plus the rank's parameter shard (fp32 under `32-true`; what TP leaves
    whole is sharded over dp only). A model built whole on the host (`built_on_host`):
    the runtime plus the full model in fp32 (4 bytes x params).
    """
    hw = cfg.hardware
    gpu = hw.accelerator == "gpu"
    runtime = RUNTIME_HOST_BYTES["gpu" if gpu else "cpu"]
    where = f"{runtime / GB:g} GB runtime"
    if built_on_host(cfg):
        return runtime + 4.0 * params, f"{where} + the whole model in fp32, built on the host"
    if gpu:
        return runtime + 4.0 * largest_param(cfg), f"{where} + the largest parameter in fp32, meta build"
    p = per_param_bytes(name, hw.precision, cfg.optim)[0]
    n = state_shards(layout) if strategies.option(name).states == "all" else 1
    rep = min(params, tp_replicated_params(cfg)) if layout.tp > 1 else 0.0
    shard = p * ((params - rep) / (layout.tp * n) + rep / n)
    return runtime + shard, f"{where} + this rank's parameters at {p:g} bytes each"


def build_host_ok(cfg: DictConfig, per_rank: float) -> bool:
    """Whether one node's host holds the build of all its ranks (HOST_USABLE of host memory)."""
    hw = cfg.hardware
    return hw.devices * per_rank <= HOST_USABLE * hw.host_memory_gb * GB
