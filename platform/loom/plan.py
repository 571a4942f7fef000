"""What a run will cost, computed before any process starts (no torch import).

Memory per device follows the ZeRO paper (Rajbhandari et al., 2020, section 3 and fig. 1):
with mixed-precision Adam, DDP holds 16 bytes per parameter, stage 1 4 + 12/N, stage 2
2 + 14/N, stage 3 (and FSDP, which shards the same three states) 16/N. In fp32 (CPU) the
same 16 bytes split 4 params / 4 grads / 8 optimizer states.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig

from loom.models.spec import model_spec

GB = 1e9
# Order in which `loom plan` suggests a strategy that fits: least communication first.
CHEAPEST_FIRST = ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload")


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


def state_bytes(strategy: str, n_params: float, n_shards: int, mixed: bool) -> MemoryEstimate:
    """Params / grads / optimizer bytes per device for one strategy (activations excluded)."""
    P, N = n_params, n_shards
    p, g, o = (2.0, 2.0, 12.0) if mixed else (4.0, 4.0, 8.0)
    if strategy in ("single", "ddp"):
        return MemoryEstimate(p * P, g * P, o * P, 0.0)
    if strategy == "zero1":
        return MemoryEstimate(p * P, g * P, o * P / N, 0.0)
    if strategy == "zero2":
        return MemoryEstimate(p * P, g * P / N, o * P / N, 0.0)
    if strategy in ("zero3", "fsdp", "fsdp_tp"):
        return MemoryEstimate(p * P / N, g * P / N, o * P / N, 0.0)
    if strategy == "zero3_offload":
        return MemoryEstimate(p * P / N, g * P / N, 0.0, 0.0, host_offload=o * P / N)
    raise ValueError(f"no memory model for strategy {strategy}")


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
    """The profile's datasheet peak for the precision in use, or None (MFU is then null)."""
    key = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "32-true": "fp32"}[hw.precision]
    value = (hw.peak_tflops or {}).get(key)
    return float(value) * 1e12 if value else None


def tensor_parallel(cfg: DictConfig) -> int:
    return int(cfg.strategy.get("tensor_parallel", 1) or 1)


def make_plan(cfg: DictConfig) -> dict[str, Any]:
    hw, s = cfg.hardware, cfg.strategy
    world = hw.devices * hw.num_nodes
    tp = tensor_parallel(cfg)
    dp = world // tp
    accum = cfg.trainer.accumulate_grad_batches
    micro = cfg.dataset.batch_size
    global_batch = micro * accum * dp
    spec = model_spec(cfg)
    mixed = hw.precision != "32-true"
    shards = world if s.name not in ("single", "ddp") else 1
    mem = state_bytes(s.name, spec.params, shards, mixed)
    mem.activations = activation_bytes(cfg, tp, mixed)
    capacity, where = _capacity(hw)
    fits = mem.total <= capacity * GB
    host_ok = True
    if mem.host_offload:
        host_ok = mem.host_offload * hw.devices <= hw.host_memory_gb * GB * 0.8
        fits = fits and host_ok
    grad_bytes = (2 if mixed else 4) * spec.params
    # Per device, per step: ring all-reduce ~2x the gradient bytes; reduce-scatter +
    # all-gather the same; ZeRO-3/FSDP add one more all-gather of the params (1.5x).
    comm_factor = 0.0 if world == 1 else (3.0 if s.name in ("zero3", "zero3_offload", "fsdp", "fsdp_tp") else 2.0)
    plan: dict[str, Any] = {
        "strategy": s.name,
        "hardware": hw.name,
        "world_size": world,
        "num_nodes": hw.num_nodes,
        "devices_per_node": hw.devices,
        "data_parallel": dp,
        "tensor_parallel": tp,
        "micro_batch": micro,
        "accumulate_grad_batches": accum,
        "global_batch": global_batch,
        "tokens_per_step": global_batch * cfg.dataset.seq_len,
        "params": spec.params,
        "flops_per_token": spec.flops_per_token,
        "flops_per_step": spec.flops_per_token * global_batch * cfg.dataset.seq_len,
        "peak_flops_per_device": peak_flops(hw),
        "precision": hw.precision,
        "memory_per_device_bytes": {**asdict(mem), "states": mem.states, "total": mem.total},
        "capacity_per_device_bytes": capacity * GB,
        "capacity_source": where,
        "comm_bytes_per_step_per_device": comm_factor * grad_bytes * (world - 1) / max(1, world),
        "fits": fits,
        "host_memory_ok": host_ok,
        "suggestion": None,
    }
    if not fits:
        plan["suggestion"] = _cheapest_fit(cfg, spec.params, mixed, tp, capacity)
    return plan


def _capacity(hw: DictConfig) -> tuple[float, str]:
    if hw.accelerator == "gpu" and hw.device_memory_gb:
        return float(hw.device_memory_gb), f"{hw.device_name} memory"
    return float(hw.host_memory_gb) / max(1, hw.devices), "host memory / processes per node"


def _cheapest_fit(cfg: DictConfig, params: int, mixed: bool, tp: int, capacity: float) -> str | None:
    world = cfg.hardware.devices * cfg.hardware.num_nodes
    act = activation_bytes(cfg, tp, mixed)
    for name in CHEAPEST_FIRST:
        if name == cfg.strategy.name or (world == 1 and name != "zero3_offload"):
            continue
        mem = state_bytes(name, params, world if name != "ddp" else 1, mixed)
        host_ok = mem.host_offload * cfg.hardware.devices <= cfg.hardware.host_memory_gb * GB * 0.8
        if mem.states + act <= capacity * GB and host_ok:
            return name
    return None


def render(plan: dict[str, Any]) -> None:
    """The plan as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    mem = plan["memory_per_device_bytes"]
    t = Table(title=f"loom plan: {plan['strategy']} on {plan['hardware']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("world size", f"{plan['world_size']} ({plan['num_nodes']} node(s) x {plan['devices_per_node']}), "
                       f"dp={plan['data_parallel']} tp={plan['tensor_parallel']}"),
        ("batch", f"micro {plan['micro_batch']} x accum {plan['accumulate_grad_batches']} x dp "
                  f"{plan['data_parallel']} = global {plan['global_batch']} "
                  f"({plan['tokens_per_step']:,} tokens/step)"),
        ("model", f"{plan['params'] / 1e6:,.1f}M params, {plan['flops_per_token'] / 1e9:,.3f} GFLOP/token"),
        ("precision", plan["precision"]),
        ("params / grads / optim", f"{mem['params'] / GB:,.2f} / {mem['grads'] / GB:,.2f} / "
                                   f"{mem['optimizer'] / GB:,.2f} GB per device"),
        ("activations", f"{mem['activations'] / GB:,.2f} GB per device"),
        ("total", f"{mem['total'] / GB:,.2f} GB of {plan['capacity_per_device_bytes'] / GB:,.2f} GB "
                  f"({plan['capacity_source']})"),
    ]
    if mem["host_offload"]:
        rows.append(("offloaded to host", f"{mem['host_offload'] / GB:,.2f} GB per device"))
    rows.append(("communication", f"{plan['comm_bytes_per_step_per_device'] / GB:,.3f} GB per device per step"))
    peak = plan["peak_flops_per_device"]
    rows.append(("peak", f"{peak / 1e12:,.1f} TFLOP/s per device" if peak else "unknown (MFU will be null)"))
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    if not plan["fits"]:
        verdict += (f"; strategy={plan['suggestion']} would fit" if plan["suggestion"]
                    else "; no strategy fits this hardware: use more devices or a smaller model")
    rows.append(("verdict", verdict))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
