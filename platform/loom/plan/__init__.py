"""Stage 3, plan: what a run will cost, computed before any process starts (no torch import).

`make_plan` returns a typed `Plan`; `Plan.to_dict()` is what plan.json holds and what
`loom plan --json` writes. The arithmetic is in `memory.py` (see its docstring for the
ZeRO paper's bytes per parameter), the table in `render.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom import data, strategies
from loom.compose import group_options
from loom.float8.checks import strategy_refused
from loom.hardware.machine import usable_cores
from loom.hardware.peaks import precision_key
from loom.layout import ParallelLayout
from loom.models import model_spec, trainable_params
from loom.models.spec import ModelSpec
from loom.optim import run_warnings as optim_warnings
from loom.plan.context import collective, context_summary, cp_degrees
from loom.plan.evaluation import eval_cost
from loom.plan.experts import experts_summary
from loom.plan.float8 import float8_summary, float8_warnings, peaks, wire_adjusted
from loom.plan.memory import (
    GB,
    HOST_USABLE,
    MemoryEstimate,
    build_host_bytes,
    build_host_ok,
    capacity,
    comm_bytes,
    fits,
    host_ok,
    memory_of,
    offloads_optimizer,
    per_param_bytes,
    tp_bytes,
    wire_bytes,
)
from loom.plan.messages import comm_messages
from loom.plan.pipeline import p2p_bytes, pipeline_summary
from loom.plan.reference import reference_cost
from loom.strategies.deepspeed_config import resolve_deepspeed, resolved_deepspeed_config, zero_stage
from loom.strategies.registry import cheapest_first

# trainer.activation_checkpointing, least recompute first.
AC_MODES = ("none", "selective", "full")


@dataclass
class Plan:
    """Everything `loom plan` prints and plan.json holds (field order = the file's key order)."""

    strategy: str
    strategy_config: dict[str, Any]
    deepspeed_config: dict[str, Any] | None
    hardware: str
    resolved_from: str | None
    accelerator: str
    device_name: str
    backend: str
    interconnect: str
    world_size: int
    num_nodes: int
    devices_per_node: int
    data_parallel: int
    tensor_parallel: int
    micro_batch: int
    accumulate_grad_batches: int
    global_batch: int
    seq_len: int | None
    items_per_sample: int
    tokens_per_step: int
    params: int | None
    non_embedding_params: int | None
    flops_per_token: float | None
    flops_per_step: float | None
    peak_flops_per_device: float | None
    precision: str
    bytes_per_param: dict[str, float]
    memory_per_device_bytes: dict[str, float]
    capacity_per_device_bytes: float | None
    capacity_source: str
    max_micro_batch: int | None
    comm_bytes_per_step_per_device: float
    comm_bytes_by_collective: dict[str, float]
    comm_time_s_at_measured_busbw: float | None
    fits: bool
    host_memory_ok: bool
    activation_checkpointing: str = "none"
    build_host_bytes_per_rank: float = 0.0   # peak host memory of one rank while the model is built
    build_host_source: str = ""              # how that is counted (memory.build_host_bytes)
    build_host_ok: bool = True               # devices per node x build_host_bytes_per_rank fits the host
    host_capacity_bytes: float | None = None  # usable host memory per node (HOST_USABLE x host_memory_gb)
    # the same bytes by mesh dimension: {data_parallel, tensor_parallel, pipeline}
    comm_bytes_by_dimension: dict[str, float] = field(default_factory=dict)
    # calls per device per step by dimension (plan.messages): what latency costs, beside the bytes
    comm_messages_per_step: dict[str, float] = field(default_factory=dict)
    # a mixture of experts: how strategy.ep splits them, active parameters, all-to-all (plan.experts)
    experts: dict[str, Any] | None = None
    # strategy.cp > 1: {cp, style, seq_len, tokens_per_rank, activation_divisor, state_shards, heads, kv_heads,
    # head_dim, collective, bytes_per_layer, calls_per_layer: {forward, backward} per micro batch,
    # recomputed_share, bytes_per_step_per_device, calls_per_step} (plan/context.py)
    context_parallel: dict[str, Any] | None = None
    suggestion: str | None = None            # the strategy that would fit (may be the run's own)
    suggestion_overrides: list[str] = field(default_factory=list)  # the overrides that make it fit
    warnings: list[str] = field(default_factory=list)
    # {dp_replicate, dp_shard, tp, pp, ep, pp_schedule, pp_microbatches} (summary.json's `parallel`)
    parallel: dict[str, Any] = field(default_factory=dict)
    # pp > 1: {schedule, microbatches, stages_per_rank, bubble_fraction, stages: [per pipeline
    # rank: stages, blocks, params, microbatches_in_flight, memory_bytes]} (plan.pipeline)
    pipeline: dict[str, Any] | None = None
    # strategy=auto: {strategy, degrees, overrides, predicted_step_s, candidates_considered,
    # candidates_fitting, tied_with, runner_up, runner_up_slower_by, reason, ...} (plan/auto.py)
    auto_choice: dict[str, Any] | None = None
    # {seq_len, micro_batch, accumulate_grad_batches, global_batch}: each {value, key, source,
    # detail}, where the value came from (plan/assumptions.py; filled by pipeline.plan_run)
    assumptions: dict[str, Any] = field(default_factory=dict)
    # parameters with gradients and optimizer state when not all (model.lora: the adapters); null: all
    trainable_params: int | None = None
    # eval.tasks: {evaluations, requests_per_evaluation, tokens_per_evaluation, seconds_per_evaluation,
    # seconds, rate_flops, rate_source, tasks: {task: {documents, requests, tokens, assumed}}} (plan/evaluation.py)
    evaluation: dict[str, Any] | None = None
    # a preference objective's reference model: {mode, bytes_per_device, flops_per_step, flops_once, options,
    # pairs, recommended, why} (plan/reference.py); online's copy is in memory_per_device_bytes.params
    reference: dict[str, Any] | None = None
    # the hardware.peak_tflops key of peak_flops_per_device (MFU's basis): bf16, fp32, tf32, ... or fp8 / mxfp8
    peak_precision: str | None = None
    # float8 on: hardware.precision's peak beside the float8 one (perf/mfu_bf16_peak's basis); else null
    peak_flops_per_device_bf16: float | None = None
    # float8 on: {recipe, emulated, all_gather, all_gather_requested, peak_precision, skip, auto_filter,
    # converted_params, flops_share, compute_speedup, cast_bytes_per_device} (plan/float8.py)
    float8: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def make_plan(cfg: DictConfig) -> Plan:
    """The plan of a validated config (the worker reads `global_batch` and `peak_flops_per_device`)."""
    hw, s = cfg.hardware, cfg.strategy
    layout = strategies.layout_of(cfg)
    micro, accum = cfg.dataset.batch_size, cfg.trainer.accumulate_grad_batches
    global_batch = layout.global_batch(micro, accum)
    spec = model_spec(cfg)
    tokens = global_batch * spec.items_per_sample  # classification: one item per sample
    params = spec.params or 0  # None: unknown before the model is built (custom)
    mem = memory_of(cfg, s.name, layout, params)
    peak_pair = peaks(cfg)  # (MFU's peak, hardware.precision's under float8, MFU's peak key)
    f8 = float8_summary(cfg, layout, spec, peak_pair)
    mem.float8_cast = f8["cast_bytes_per_device"] if f8 else 0.0
    pipe = pipeline_summary(cfg, s.name, layout)
    if pipe:  # a device holds its stages only: the plan's memory is the fullest stage's
        mem = _fullest_stage(pipe, mem)
    cap, where = capacity(hw)
    reference = reference_cost(cfg, layout, params, spec.flops_per_token, global_batch, data.pair_count(cfg),
                               None if cap is None else cap - mem.total)
    if reference is not None and reference["mode"] == "online":  # the frozen copy beside the policy
        mem.params += reference["bytes_per_device"]
    comm = comm_bytes(cfg, s.name, params, layout) if layout.world > 1 else {}
    if layout.pp > 1:
        comm["pipeline_send"] = p2p_bytes(cfg, layout)
    comm = wire_adjusted(cfg, layout, comm, params, f8 and f8["converted_params"], wire_bytes(cfg, s.name)[0])
    peak = peak_pair[0]
    build, build_source = build_host_bytes(cfg, s.name, layout, params)
    build_ok = build_host_ok(cfg, build)
    plan = Plan(
        strategy=s.name, strategy_config=OmegaConf.to_container(s, resolve=True),
        deepspeed_config=resolved_deepspeed_config(cfg, layout) if zero_stage(s.name) else None,
        hardware=hw.name, resolved_from=hw.get("resolved_from"), accelerator=hw.accelerator,
        device_name=hw.device_name, backend=hw.backend, interconnect=hw.interconnect,
        world_size=layout.world, num_nodes=layout.num_nodes, devices_per_node=hw.devices,
        data_parallel=layout.dp, tensor_parallel=layout.tp, micro_batch=micro,
        accumulate_grad_batches=accum, global_batch=global_batch, seq_len=cfg.dataset.get("seq_len"),
        items_per_sample=spec.items_per_sample, tokens_per_step=tokens, params=spec.params,
        non_embedding_params=spec.non_embedding_params, flops_per_token=spec.flops_per_token,
        flops_per_step=spec.flops_per_token * tokens if spec.flops_per_token is not None else None,
        peak_flops_per_device=peak, precision=hw.precision,
        bytes_per_param=dict(zip(("params", "grads", "optimizer"), per_param_bytes(s.name, hw.precision, cfg.optim),
                                 strict=True)),
        memory_per_device_bytes={**dataclasses.asdict(mem), "states": mem.states, "total": mem.total},
        capacity_per_device_bytes=cap, capacity_source=where,
        max_micro_batch=_max_micro_batch(cfg, mem, cap, micro),
        comm_bytes_per_step_per_device=sum(comm.values()), comm_bytes_by_collective=comm,
        comm_bytes_by_dimension=_by_dimension(cfg, comm, layout),
        comm_time_s_at_measured_busbw=_comm_time(hw, sum(comm.values())),
        comm_messages_per_step=comm_messages(cfg, s.name, params, layout),
        fits=fits(cfg, mem, cap) and build_ok, host_memory_ok=host_ok(cfg, mem),
        activation_checkpointing=cfg.trainer.activation_checkpointing,
        build_host_bytes_per_rank=build, build_host_source=build_source, build_host_ok=build_ok,
        host_capacity_bytes=HOST_USABLE * float(hw.host_memory_gb) * GB,
        warnings=_warnings(cfg, spec, peak_pair, cap) + float8_warnings(cfg, layout), parallel=layout.parallel(),
        pipeline=pipe, peak_precision=peak_pair[2], peak_flops_per_device_bf16=peak_pair[1], float8=f8,
        trainable_params=trainable_params(cfg),
        experts=experts_summary(cfg, layout, spec.active_params, _a2a_bandwidth(hw)),
        context_parallel=context_summary(cfg, layout),
    )
    plan.evaluation = eval_cost(cfg, spec.flops_per_token, peak)
    plan.reference = reference
    if not plan.fits:
        fix = (_own_with_checkpointing(cfg, params, layout, cap) or _own_with_context(cfg, params, layout, cap)
               or _cheapest_fit(cfg, params, layout, cap))
        if fix is not None:
            plan.suggestion, plan.suggestion_overrides = fix
    return plan


def _fullest_stage(pipe: dict[str, Any], mem: MemoryEstimate) -> MemoryEstimate:
    """The pipeline rank with the most memory (the first stage under 1F1B), as the device's
    estimate; the runtime (CPU) is the whole-model estimate's."""
    worst = max(pipe["stages"], key=lambda st: st["memory_bytes"]["total"])["memory_bytes"]
    keys = ("params", "grads", "optimizer", "activations", "host_offload")
    return MemoryEstimate(*(worst[k] for k in keys), runtime=mem.runtime,
                          grads_in_forward=worst.get("grads_in_forward", True))


def _max_micro_batch(cfg: DictConfig, mem: MemoryEstimate, cap: float | None, micro: int) -> int | None:
    """The largest micro batch whose activations fit beside the states (None: unknown)."""
    per_sample = mem.activations / micro if micro else 0.0
    if cap is None or not per_sample:
        return None
    room = cap - mem.params - mem.optimizer - mem.runtime - mem.float8_cast - (mem.host_offload if cfg.hardware.accelerator != "gpu" else 0.0)
    if mem.grads_in_forward:
        room -= mem.grads
    elif mem.grads > room:  # the gradients alone do not fit beside the weights and states
        return 0
    return max(0, int(room // per_sample))


def _by_dimension(cfg: DictConfig, comm: dict[str, float], layout) -> dict[str, float]:
    """`comm_bytes_by_collective` regrouped by the mesh dimension the bytes cross."""
    tp = tp_bytes(cfg, layout) if comm else 0.0
    pipe, a2a, cp = comm.get("pipeline_send", 0.0), comm.get("all_to_all", 0.0), comm.get(collective(layout), 0.0)
    return {"data_parallel": sum(comm.values()) - tp - pipe - a2a - cp, "tensor_parallel": tp, "pipeline": pipe,
            "expert_parallel": a2a, "context_parallel": cp}


def _a2a_bandwidth(hw: DictConfig) -> float | None:
    """GB/s the all-to-all's exposed time is reckoned at: the probed bus bandwidth, else the
    profile's interconnect figure (plan.compare's own reading of it)."""
    from loom.plan.links import bandwidth

    return bandwidth(hw)[0]


def _comm_time(hw: DictConfig, comm_total: float) -> float | None:
    busbw = (hw.get("measured") or {}).get("allreduce_busbw_gbps") if hw.get("measured") else None
    return comm_total / (busbw * GB) if busbw and comm_total else None


def _warnings(cfg: DictConfig, spec: ModelSpec, peak_pair: tuple[float | None, float | None, str | None],
              cap: float | None) -> list[str]:
    hw, (peak, _, key) = cfg.hardware, peak_pair
    out: list[str] = []
    if peak is None:
        key = key or precision_key(hw) or hw.precision
        out.append(f"hardware={hw.name} ({hw.device_name}) has no hardware.peak_tflops.{key}: MFU will be "
                   f"null. Set it from the device's datasheet or select a profile written by `loom probe`.")
    if spec.params is None:
        out.append(f"model={cfg.model.name}: parameter count unknown before the model is built: "
                   "memory and communication are not estimated.")
    if cap is None:
        out.append(f"hardware={hw.name}: device memory unknown, the fit is not checked "
                   "(set hardware.device_memory_gb).")
    cores = usable_cores()
    if hw.accelerator == "cpu" and hw.launcher != "slurm" and hw.devices > cores:  # ranks run here
        out.append(f"hardware.devices={hw.devices} CPU processes on this machine's {cores} usable core(s): "
                   f"the ranks share the cores and each step is slower than with hardware.devices<={cores}"
                   + (f" (`loom train` refuses more than {4 * cores})" if hw.devices > 4 * cores else "") + ".")
    attention = 12 * spec.layers * spec.width * spec.items_per_sample  # per token, as the FLOP count has it
    note = data.packing_note(cfg, attention / spec.flops_per_token) if spec.flops_per_token else None
    if note:
        out.append(note)
    if zero_stage(cfg.strategy.name):  # e.g. a JSON scheduler whose shape is not Loom's schedule
        out += resolve_deepspeed(cfg, strategies.layout_of(cfg)).warnings
    return out + optim_warnings(cfg)  # e.g. optim.lr=0: accepted, said once


Fix = tuple[str, list[str]]  # (strategy, the overrides that select it and its checkpointing)


def _stronger_checkpointing(cfg: DictConfig) -> tuple[str, ...]:
    """The activation checkpointing modes beyond the run's own, least recompute first."""
    return AC_MODES[AC_MODES.index(cfg.trainer.activation_checkpointing) + 1:]


def _fits_with(cfg: DictConfig, name: str, layout: ParallelLayout, params: float, cap: float | None,
               ac: str) -> bool:
    """Device memory, offload host memory and the build's host memory of `name` with `ac`."""
    mem = memory_of(cfg, name, layout, params, ac)
    return fits(cfg, mem, cap) and build_host_ok(cfg, build_host_bytes(cfg, name, layout, params)[0])


def _own_with_checkpointing(cfg: DictConfig, params: float, layout: ParallelLayout,
                            cap: float | None) -> Fix | None:
    """The run's own strategy with the least activation checkpointing that makes it fit."""
    for ac in _stronger_checkpointing(cfg):
        if _fits_with(cfg, cfg.strategy.name, layout, params, cap, ac):
            return cfg.strategy.name, [f"trainer.activation_checkpointing={ac}"]
    return None


def _own_with_context(cfg: DictConfig, params: float, layout: ParallelLayout, cap: float | None) -> Fix | None:
    """The run's own strategy (fsdp, fsdp_tp, nd at strategy.cp=1) split over the fewest cp ranks, with
    the least activation checkpointing, that fits; the global batch kept with cp x the accumulation."""
    from loom.errors import ConfigError
    from loom.validate import with_strategy

    s, own_ac, accum = cfg.strategy, cfg.trainer.activation_checkpointing, int(cfg.trainer.accumulate_grad_batches)
    if "cp" not in s or int(s.cp) != 1:
        return None
    for ac in (own_ac, *_stronger_checkpointing(cfg)):
        for cp in cp_degrees(cfg, layout.world):
            node = s.copy()
            node.cp = cp
            try:
                valid = with_strategy(cfg, node)
            except ConfigError:
                continue  # heads, or the degrees, do not divide
            valid.trainer.accumulate_grad_batches = accum * cp
            if _fits_with(valid, s.name, strategies.layout_of(valid), params, cap, ac):
                extra = [f"trainer.activation_checkpointing={ac}"] if ac != own_ac else []
                return s.name, [f"strategy.cp={cp}", f"trainer.accumulate_grad_batches={accum * cp}", *extra]
    return None


def _cheapest_fit(cfg: DictConfig, params: float, layout: ParallelLayout, cap: float | None) -> Fix | None:
    """The first strategy of the registry's `cheapest_first` (with a yaml) whose estimate fits with the run's
    own activation checkpointing; failing that, with selective, then full (recomputing costs
    a third more compute at most, so a cheaper strategy is tried without it first)."""
    have, own_ac = set(group_options("strategy")), cfg.trainer.activation_checkpointing
    for ac in (own_ac, *_stronger_checkpointing(cfg)):
        for name in cheapest_first():
            if name == cfg.strategy.name or name not in have:
                continue
            offload = offloads_optimizer(name)
            if layout.dp == 1 and not offload:
                continue  # one rank: sharding over 1 saves nothing (offloading still does)
            if cfg.hardware.accelerator != "gpu" and offload:
                continue  # on CPU the host *is* the device
            if strategy_refused(cfg, name):
                continue  # float8 does not train under it (loom.float8.checks)
            if _fits_with(cfg, name, strategies.layout_of(cfg, name=name), params, cap, ac):
                extra = [f"trainer.activation_checkpointing={ac}"] if ac != own_ac else []
                return name, [f"strategy={name}", *extra]
    return None
