"""Memory and communication per device: the arithmetic of `loom plan` (no torch import).

Memory per device follows the ZeRO paper (Rajbhandari et al., 2020, section 3 and fig. 1):
with mixed-precision Adam, DDP holds 16 bytes per parameter, stage 1 4 + 12/N, stage 2
2 + 14/N, stage 3 (and FSDP, which shards the same three states) 16/N. In fp32 (CPU) the
same 16 bytes split 4 params / 4 grads / 8 optimizer states.

Which split applies depends on who implements the precision. DeepSpeed (zero*) keeps 16-bit
params and grads plus an fp32 master copy inside the optimizer: the paper's 2 / 2 / 12; in
fp32 it still clones the fp32 partition it steps, so 4 / 4 / 12 (measured on CPU).
Lightning's `*-mixed` for ddp / fsdp is autocast: parameters and gradients stay fp32 and
only the compute is 16-bit: 4 / 4 / 8. The totals agree; the split and the bytes on the wire
differ. `bf16-true` casts everything, the Adam moments too: 2 / 2 / 4.
fsdp_tp: the Block linears are split over tp x dp ranks; what tensor parallelism leaves
replicated (embeddings, head, norms, row-parallel biases) is sharded over dp only.

Written by hand (not DeepSpeed's `estimate_zero*_model_states_mem_needs`) because the plan
must answer in well under a second, before torch, Lightning or DeepSpeed are imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from omegaconf import DictConfig, OmegaConf

from loom import strategies
from loom.compose import conf_dir
from loom.layout import ParallelLayout
from loom.strategies.deepspeed_config import zero_stage

GB = 1e9
# Share of a device's memory the plan lets a run use: the CUDA context, NCCL buffers and the
# caching allocator's fragmentation take the rest. Host: the OS and the Python/torch runtime.
GPU_USABLE = 0.90
HOST_USABLE = 0.80


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    host_offload: float = 0.0    # optimizer (and params) moved to host memory

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations


def per_param_bytes(strategy: str, precision: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter for a strategy at a precision."""
    if zero_stage(strategy) is not None:
        # fp32 master partition (a copy even when the model is fp32), momentum, variance
        return (4.0, 4.0, 12.0) if precision == "32-true" else (2.0, 2.0, 12.0)
    if precision == "32-true":
        return 4.0, 4.0, 8.0
    if precision == "bf16-true":
        return 2.0, 2.0, 4.0
    return 4.0, 4.0, 8.0        # autocast: fp32 params and grads, fp32 Adam moments


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
) -> MemoryEstimate:
    """Params / grads / optimizer bytes per device for one strategy (activations excluded).

    `mixed` picks the ZeRO paper's 2/2/12 bytes per parameter (else fp32's 4/4/8) unless
    `per_param` gives the split. `n_shards` is the data-parallel size the states are
    partitioned over (ignored by single/ddp). Offload moves the optimizer states (and with
    `offload_params` the parameter shards) to host memory: `host_offload`. Which states a
    strategy partitions is its registry entry's `states`.
    """
    P, N = float(n_params), max(1, int(n_shards))
    p, g, o = per_param or ((2.0, 2.0, 12.0) if mixed else (4.0, 4.0, 8.0))
    states = strategies.option(strategy).states
    mem = MemoryEstimate(
        p * P / (N if states == "all" else 1),
        g * P / (N if states in ("all", "optimizer+grads") else 1),
        o * P / (N if states != "none" else 1),
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


def activation_bytes(cfg: DictConfig, tp: int, mixed: bool) -> float:
    """Stored activations of one micro batch (Korthikanti et al. 2022, eq. 2, flash attention:
    34*s*b*h bytes per layer in 16-bit, split across TP ranks) plus the fp32 logits."""
    m = cfg.model
    if "d_model" not in m:
        return 0.0
    b, s = cfg.dataset.batch_size, cfg.dataset.seq_len
    per_layer = 34 * s * b * m.d_model * (1.0 if mixed else 2.0) / tp
    logits = 2 * 4 * b * s * m.vocab_size / tp  # fp32 logits and their gradient
    return m.n_layer * per_layer + logits


def tp_replicated_params(cfg: DictConfig) -> float:
    """Parameters tensor parallelism leaves whole on every TP rank (GPT of loom.models.gpt
    under models.lit's plan: q/k/v/fc colwise, proj rowwise): embeddings, positions, the
    head, every LayerNorm, and the two row-parallel biases per block."""
    m = cfg.model
    if "d_model" not in m:
        return 0.0
    d = m.d_model
    return float(2 * m.vocab_size * d + m.block_size * d + 2 * d + m.n_layer * (4 * d + 2 * d))


def memory_of(cfg: DictConfig, name: str, layout: ParallelLayout, params: float) -> MemoryEstimate:
    """Per-device memory of strategy `name` (the run's own, or an alternative) at `layout`."""
    hw, s = cfg.hardware, cfg.strategy
    own = name == s.name
    kw = dict(
        per_param=per_param_bytes(name, hw.precision),
        offload_optimizer=bool(s.offload_optimizer) if own and "offload_optimizer" in s else None,
        offload_params=bool(s.get("offload_params", False)) if own else False,
    )
    mixed, tp = hw.precision != "32-true", layout.tp
    if tp > 1:  # TP-split Block weights over dp x tp; what TP replicates over dp only
        rep = min(params, tp_replicated_params(cfg))
        split = state_bytes(name, params - rep, layout.dp_shard * tp, mixed, **kw)
        whole = state_bytes(name, rep, layout.dp_shard, mixed, **kw)
        mem = MemoryEstimate(split.params + whole.params, split.grads + whole.grads,
                             split.optimizer + whole.optimizer, 0.0, split.host_offload + whole.host_offload)
    else:
        mem = state_bytes(name, params, layout.dp_shard, mixed, **kw)
    if own and s.get("reshard_after_forward") is False:
        # Params stay gathered from forward to backward: the whole (TP-local) model in
        # compute precision on every rank.
        mem.params += (2.0 if mixed else 4.0) * params / tp
    mem.activations = activation_bytes(cfg, tp, mixed)
    return mem


def comm_bytes(cfg: DictConfig, name: str, params: float, layout: ParallelLayout) -> dict[str, float]:
    """Bytes each device sends per optimizer step, by collective (ring algorithms: an
    all-reduce of S bytes moves 2(n-1)/n*S, a reduce-scatter or all-gather (n-1)/n*S).

    ddp / zero1 reduce once per step (Lightning skips the sync of accumulation steps);
    zero2 reduce-scatters every micro batch; zero3 / fsdp gather the params for forward and
    again for backward and reduce-scatter the grads every micro batch (1.5x ddp's volume).
    Tensor parallelism adds 4 activation all-reduces per layer per micro batch across the TP group.
    """
    hw, s = cfg.hardware, cfg.strategy
    own = name == s.name
    accum = cfg.trainer.accumulate_grad_batches
    p, g, _ = per_param_bytes(name, hw.precision)
    if own and s.get("comm_hook") in ("fp16_compress", "bf16_compress"):
        g = 2.0
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    group = layout.dp_shard if layout.hybrid else layout.dp  # the group states are reduced over
    frac = (group - 1) / group if group > 1 else 0.0
    local = params / layout.tp
    states = strategies.option(name).states
    if states == "none":
        out["all_reduce"] = 2 * frac * g * local
    elif states == "optimizer":
        out["reduce_scatter"] = frac * g * local
        out["all_gather"] = frac * p * local
    elif states == "optimizer+grads":
        out["reduce_scatter"] = accum * frac * g * local
        out["all_gather"] = frac * p * local
    else:
        gathers = 1 if own and s.get("reshard_after_forward") is False else 2
        out["all_gather"] = accum * gathers * frac * p * local
        out["reduce_scatter"] = accum * frac * g * local
        if layout.hybrid:  # HSDP: all-reduce the grad shards across nodes
            nodes = layout.num_nodes
            out["all_reduce"] = 2 * (nodes - 1) / nodes * g * local / group
    if layout.tp > 1:
        m, tp = cfg.model, layout.tp
        act = 2.0 if hw.precision != "32-true" else 4.0
        volume = cfg.dataset.batch_size * cfg.dataset.seq_len * m.d_model * act
        out["all_reduce"] += accum * 4 * m.n_layer * 2 * (tp - 1) / tp * volume
    return out


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


