"""What a run will cost, computed before any process starts (no torch import).

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

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.models.spec import model_spec

GB = 1e9
# Order in which `loom plan` suggests a strategy that fits: least communication first.
CHEAPEST_FIRST = ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload")
SHARDED = ("zero3", "zero3_offload", "fsdp", "fsdp_tp")
DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload")
# Share of a device's memory the plan lets a run use: the CUDA context, NCCL buffers and the
# caching allocator's fragmentation take the rest. Host: the OS and the Python/torch runtime.
GPU_USABLE = 0.90
HOST_USABLE = 0.80
PRECISION_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


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
    if strategy in DEEPSPEED:
        # fp32 master partition (a copy even when the model is fp32), momentum, variance
        return (4.0, 4.0, 12.0) if precision == "32-true" else (2.0, 2.0, 12.0)
    if precision == "32-true":
        return 4.0, 4.0, 8.0
    if precision == "bf16-true":
        return 2.0, 2.0, 4.0
    return 4.0, 4.0, 8.0        # autocast: fp32 params and grads, fp32 Adam moments


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
    `offload_params` the parameter shards) to host memory: `host_offload`.
    """
    P, N = float(n_params), max(1, int(n_shards))
    p, g, o = per_param or ((2.0, 2.0, 12.0) if mixed else (4.0, 4.0, 8.0))
    if strategy in ("single", "ddp"):
        mem = MemoryEstimate(p * P, g * P, o * P, 0.0)
    elif strategy == "zero1":
        mem = MemoryEstimate(p * P, g * P, o * P / N, 0.0)
    elif strategy == "zero2":
        mem = MemoryEstimate(p * P, g * P / N, o * P / N, 0.0)
    elif strategy in SHARDED:
        mem = MemoryEstimate(p * P / N, g * P / N, o * P / N, 0.0)
    else:
        raise ValueError(f"no memory model for strategy {strategy}")
    if offload_optimizer is None:
        offload_optimizer = strategy == "zero3_offload"
    if offload_optimizer:
        mem.host_offload += mem.optimizer
        mem.optimizer = 0.0
    if offload_params and strategy in SHARDED:
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


def peak_flops(hw: DictConfig) -> float | None:
    """The profile's datasheet peak for the precision in use, in FLOP/s, or None (MFU is
    then null). Never a guess: no key for the precision means unknown."""
    key = PRECISION_KEY.get(hw.precision)
    value = (hw.get("peak_tflops") or {}).get(key) if key else None
    return float(value) * 1e12 if value else None


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilization per device: achieved FLOP/s / (peak x devices); None when the
    peak is unknown or the ratio is impossible (> 1 means the peak is wrong, not the run)."""
    if not peak or world < 1:
        return None
    value = tokens_per_sec * flops_per_token / (peak * world)
    return value if 0.0 <= value <= 1.0 else None


def tensor_parallel(cfg: DictConfig) -> int:
    return int(cfg.strategy.get("tensor_parallel", 1) or 1) if cfg.strategy.name == "fsdp_tp" else 1


def _shards(cfg: DictConfig, name: str, dp: int) -> int:
    """Over how many ranks a strategy partitions the states of one parameter."""
    hw, s = cfg.hardware, cfg.strategy
    if name in ("single", "ddp"):
        return 1
    if name == "fsdp" and s.get("hybrid_shard") and hw.num_nodes > 1 and s.name == "fsdp":
        return hw.devices  # HSDP: shard within a node, replicate across nodes
    if name == "fsdp_tp":
        return dp * tensor_parallel(cfg)
    return dp


def tp_replicated_params(cfg: DictConfig) -> float:
    """Parameters tensor parallelism leaves whole on every TP rank (GPT of loom.models.gpt
    under models.lit's plan: q/k/v/fc colwise, proj rowwise): embeddings, positions, the
    head, every LayerNorm, and the two row-parallel biases per block."""
    m = cfg.model
    if "d_model" not in m:
        return 0.0
    d = m.d_model
    return float(2 * m.vocab_size * d + m.block_size * d + 2 * d + m.n_layer * (4 * d + 2 * d))


def _memory(cfg: DictConfig, name: str, dp: int, tp: int, params: float) -> MemoryEstimate:
    hw, s = cfg.hardware, cfg.strategy
    own = name == s.name
    kw = dict(
        per_param=per_param_bytes(name, hw.precision),
        offload_optimizer=bool(s.get("offload_optimizer")) if own and "offload_optimizer" in s else None,
        offload_params=bool(s.get("offload_params", False)) if own else False,
    )
    mixed = hw.precision != "32-true"
    if name == "fsdp_tp" and tp > 1:
        rep = min(params, tp_replicated_params(cfg))
        split = state_bytes(name, params - rep, dp * tp, mixed, **kw)
        whole = state_bytes(name, rep, dp, mixed, **kw)
        mem = MemoryEstimate(*(a + b for a, b in zip(
            (split.params, split.grads, split.optimizer, 0.0, split.host_offload),
            (whole.params, whole.grads, whole.optimizer, 0.0, whole.host_offload), strict=True)))
    else:
        mem = state_bytes(name, params, _shards(cfg, name, dp), mixed, **kw)
    if own and name in ("fsdp", "fsdp_tp") and s.get("reshard_after_forward") is False:
        # Params stay gathered from forward to backward: the whole (TP-local) model in
        # compute precision on every rank.
        mem.params += (2.0 if hw.precision != "32-true" else 4.0) * params / tp
    mem.activations = activation_bytes(cfg, tp, hw.precision != "32-true")
    return mem


def comm_bytes(cfg: DictConfig, name: str, params: float, dp: int, tp: int) -> dict[str, float]:
    """Bytes each device sends per optimizer step, by collective (ring algorithms: an
    all-reduce of S bytes moves 2(n-1)/n*S, a reduce-scatter or all-gather (n-1)/n*S).

    ddp / zero1 reduce once per step (Lightning skips the sync of accumulation steps);
    zero2 reduce-scatters every micro batch; zero3 / fsdp gather the params for forward and
    again for backward and reduce-scatter the grads every micro batch (1.5x ddp's volume).
    fsdp_tp adds 4 activation all-reduces per layer per micro batch across the TP group.
    """
    hw, s = cfg.hardware, cfg.strategy
    accum = cfg.trainer.accumulate_grad_batches
    p, g, _ = per_param_bytes(name, hw.precision)
    if name == "ddp" and s.name == "ddp" and s.get("comm_hook") in ("fp16_compress", "bf16_compress"):
        g = 2.0
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    nodes = hw.num_nodes
    group = _shards(cfg, name, dp) if name == "fsdp" else dp  # the data-parallel group
    frac = (group - 1) / group if group > 1 else 0.0
    local = params / tp
    if name in ("single", "ddp"):
        out["all_reduce"] = 2 * frac * g * local
    elif name == "zero1":
        out["reduce_scatter"] = frac * g * local
        out["all_gather"] = frac * p * local
    elif name == "zero2":
        out["reduce_scatter"] = accum * frac * g * local
        out["all_gather"] = frac * p * local
    else:  # zero3, zero3_offload, fsdp, fsdp_tp
        gathers = 1 if (name == s.name and name in ("fsdp", "fsdp_tp")
                        and s.get("reshard_after_forward") is False) else 2
        out["all_gather"] = accum * gathers * frac * p * local
        out["reduce_scatter"] = accum * frac * g * local
        if group != dp and nodes > 1:  # HSDP: all-reduce the grad shards across nodes
            out["all_reduce"] = 2 * (nodes - 1) / nodes * g * local / group
    if name == "fsdp_tp" and tp > 1:
        m = cfg.model
        act = 2.0 if hw.precision != "32-true" else 4.0
        volume = cfg.dataset.batch_size * cfg.dataset.seq_len * m.d_model * act
        out["all_reduce"] += accum * 4 * m.n_layer * 2 * (tp - 1) / tp * volume
    return out


def _capacity(hw: DictConfig) -> tuple[float | None, str]:
    """Usable bytes per device (None: unknown) and where the number comes from."""
    if hw.accelerator == "gpu":
        if hw.device_memory_gb:
            return (GPU_USABLE * float(hw.device_memory_gb) * GB,
                    f"{GPU_USABLE:.0%} of {hw.device_name} {hw.device_memory_gb:g} GB")
        return None, f"{hw.device_name}: memory unknown (set hardware.device_memory_gb)"
    return (HOST_USABLE * float(hw.host_memory_gb) * GB / max(1, hw.devices),
            f"{HOST_USABLE:.0%} of host {hw.host_memory_gb:g} GB / {hw.devices} processes")


def _host_ok(cfg: DictConfig, mem: MemoryEstimate) -> bool:
    hw = cfg.hardware
    if hw.accelerator != "gpu":
        return True  # on CPU, offload is the same memory: counted in the device total
    return mem.host_offload * hw.devices <= HOST_USABLE * hw.host_memory_gb * GB


def _fits(cfg: DictConfig, mem: MemoryEstimate, capacity: float | None) -> bool:
    need = mem.total + (mem.host_offload if cfg.hardware.accelerator != "gpu" else 0.0)
    return (capacity is None or need <= capacity) and _host_ok(cfg, mem)


def available_strategies() -> list[str]:
    """Strategy names with a yaml in conf/strategy/ (only those can be suggested)."""
    from loom.config import group_options

    return group_options("strategy")


def make_plan(cfg: DictConfig) -> dict[str, Any]:
    """Everything `loom plan` prints and `plan.json` holds (the worker reads
    `global_batch` and `peak_flops_per_device`)."""
    hw, s = cfg.hardware, cfg.strategy
    world = hw.devices * hw.num_nodes
    tp = tensor_parallel(cfg)
    dp = max(1, world // tp)
    accum = cfg.trainer.accumulate_grad_batches
    micro = cfg.dataset.batch_size
    global_batch = micro * accum * dp
    spec = model_spec(cfg)
    tokens = global_batch * spec.items_per_sample  # classification: one item per sample
    params = spec.params or 0  # None: unknown before the model is built (custom)
    mem = _memory(cfg, s.name, dp, tp, params)
    capacity, where = _capacity(hw)
    fits = _fits(cfg, mem, capacity)
    comm = comm_bytes(cfg, s.name, params, dp, tp) if world > 1 else {}
    comm_total = sum(comm.values())
    peak = peak_flops(hw)
    warnings: list[str] = []
    if peak is None:
        key = PRECISION_KEY.get(hw.precision, hw.precision)
        warnings.append(
            f"hardware={hw.name} ({hw.device_name}) has no hardware.peak_tflops.{key}: MFU will be "
            f"null. Set it from the device's datasheet or select a profile written by `loom probe`."
        )
    if spec.params is None:
        warnings.append(f"model={cfg.model.name}: parameter count unknown before the model is built: "
                        "memory and communication are not estimated.")
    if capacity is None:
        warnings.append(f"hardware={hw.name}: device memory unknown, the fit is not checked "
                        "(set hardware.device_memory_gb).")
    measured = hw.get("measured") or {}
    busbw = measured.get("allreduce_busbw_gbps") if measured else None
    act_per_sample = mem.activations / micro if micro else 0.0
    room = (capacity - mem.states - (mem.host_offload if hw.accelerator != "gpu" else 0.0)
            if capacity is not None else None)
    plan: dict[str, Any] = {
        "strategy": s.name,
        "strategy_config": OmegaConf.to_container(s, resolve=True),
        "deepspeed_config": _deepspeed_config(cfg),
        "hardware": hw.name,
        "resolved_from": hw.get("resolved_from"),
        "accelerator": hw.accelerator,
        "device_name": hw.device_name,
        "backend": hw.backend,
        "interconnect": hw.interconnect,
        "world_size": world,
        "num_nodes": hw.num_nodes,
        "devices_per_node": hw.devices,
        "data_parallel": dp,
        "tensor_parallel": tp,
        "micro_batch": micro,
        "accumulate_grad_batches": accum,
        "global_batch": global_batch,
        "seq_len": cfg.dataset.get("seq_len"),
        "items_per_sample": spec.items_per_sample,
        "tokens_per_step": tokens,
        "params": spec.params,
        "non_embedding_params": spec.non_embedding_params,
        "flops_per_token": spec.flops_per_token,
        "flops_per_step": spec.flops_per_token * tokens if spec.flops_per_token is not None else None,
        "peak_flops_per_device": peak,
        "precision": hw.precision,
        "bytes_per_param": dict(zip(("params", "grads", "optimizer"), per_param_bytes(s.name, hw.precision), strict=True)),
        "memory_per_device_bytes": {**asdict(mem), "states": mem.states, "total": mem.total},
        "capacity_per_device_bytes": capacity,
        "capacity_source": where,
        "max_micro_batch": (max(0, int(room // act_per_sample)) if room is not None and act_per_sample
                            else None),
        "comm_bytes_per_step_per_device": comm_total,
        "comm_bytes_by_collective": comm,
        "comm_time_s_at_measured_busbw": (comm_total / (busbw * GB) if busbw and comm_total else None),
        "fits": fits,
        "host_memory_ok": _host_ok(cfg, mem),
        "suggestion": None,
        "warnings": warnings,
    }
    if not fits:
        plan["suggestion"] = _cheapest_fit(cfg, params, dp, tp, capacity)
    return plan


def _cheapest_fit(cfg: DictConfig, params: float, dp: int, tp: int, capacity: float | None) -> str | None:
    """The first strategy of CHEAPEST_FIRST (with a yaml) whose estimate fits, else None."""
    have = set(available_strategies())
    for name in CHEAPEST_FIRST:
        if name == cfg.strategy.name or name not in have:
            continue
        if dp == 1 and name != "zero3_offload":
            continue  # one rank: sharding over 1 saves nothing
        if cfg.hardware.accelerator != "gpu" and name == "zero3_offload":
            continue  # on CPU the host *is* the device
        if _fits(cfg, _memory(cfg, name, dp, 1, params), capacity):
            return name
    return None


def _deepspeed_config(cfg: DictConfig) -> dict[str, Any] | None:
    """The DeepSpeed JSON the run will use (Loom's values merged with the user's file)."""
    from loom.strategies import ZERO, resolved_deepspeed_config

    return resolved_deepspeed_config(cfg) if cfg.strategy.name in ZERO else None


def render(plan: dict[str, Any]) -> None:
    """The plan as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    mem = plan["memory_per_device_bytes"]
    bpp = plan["bytes_per_param"]
    t = Table(title=f"loom plan: {plan['strategy']} on {plan['hardware']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    hw = f"{plan['device_name']}, {plan['accelerator']}, {plan['backend']}, {plan['interconnect']}"
    if plan.get("resolved_from"):
        hw += f" (resolved from {plan['resolved_from']})"
    rows = [
        ("hardware", hw),
        ("world size", f"{plan['world_size']} ({plan['num_nodes']} node(s) x {plan['devices_per_node']}), "
                       f"dp={plan['data_parallel']} tp={plan['tensor_parallel']}"),
        ("batch", f"micro {plan['micro_batch']} x accum {plan['accumulate_grad_batches']} x dp "
                  f"{plan['data_parallel']} = global {plan['global_batch']} "
                  f"({plan['tokens_per_step']:,} tokens/step)"),
        ("model", (f"{plan['params'] / 1e6:,.1f}M params, " if plan["params"] is not None else "params unknown, ")
                  + (f"{plan['flops_per_token'] / 1e9:,.3f} GFLOP/token, {plan['flops_per_step'] / 1e12:,.2f} "
                     "TFLOP/step" if plan["flops_per_token"] is not None else "FLOPs unknown")),
        ("precision", f"{plan['precision']} ({bpp['params']:g}/{bpp['grads']:g}/{bpp['optimizer']:g} "
                      "bytes per param: params/grads/optimizer)"),
        ("params / grads / optim", f"{mem['params'] / GB:,.2f} / {mem['grads'] / GB:,.2f} / "
                                   f"{mem['optimizer'] / GB:,.2f} GB per device"),
        ("activations", f"{mem['activations'] / GB:,.2f} GB per device (micro batch {plan['micro_batch']})"),
    ]
    if mem["host_offload"]:
        rows.append(("offloaded to host", f"{mem['host_offload'] / GB:,.2f} GB per device"))
    cap = plan["capacity_per_device_bytes"]
    rows.append(("total", f"{mem['total'] / GB:,.2f} GB of "
                          + (f"{cap / GB:,.2f} GB" if cap is not None else "? GB")
                          + f" ({plan['capacity_source']})"))
    if plan["max_micro_batch"] is not None:
        rows.append(("max micro batch", f"{plan['max_micro_batch']} (activations permitting)"))
    comm = plan["comm_bytes_per_step_per_device"]
    detail = ", ".join(f"{k} {v / GB:,.3f}" for k, v in plan["comm_bytes_by_collective"].items() if v)
    line = f"{comm / GB:,.3f} GB per device per step" + (f" ({detail})" if detail else "")
    if plan["comm_time_s_at_measured_busbw"]:
        line += f", ~{plan['comm_time_s_at_measured_busbw']:.3f} s at the probed bus bandwidth"
    rows.append(("communication", line))
    peak = plan["peak_flops_per_device"]
    rows.append(("peak", f"{peak / 1e12:,.4g} TFLOP/s per device ({plan['precision']})" if peak
                 else "unknown (MFU will be null)"))
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    if not plan["fits"]:
        verdict += (f"; strategy={plan['suggestion']} would fit" if plan["suggestion"]
                    else "; no strategy fits this hardware: use more devices, a smaller model or "
                         "a smaller dataset.batch_size")
    rows.append(("verdict", verdict))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
