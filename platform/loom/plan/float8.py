"""What `float8` changes in the plan (no torch import): plan.json `float8`, the peak MFU is measured
against, the compute rate of the step-time estimate, the transient float8 weight copies and FSDP2's
float8 all-gather. docs/float8.md shows the figures.

- Converted parameters (`converted_params`): every matmul parameter of the model but the skipped head
  (`float8.skip` names `lm_head` / `score`, Loom's head modules), i.e. the blocks' Linear layers. Layers
  `float8.auto_filter` keeps in high precision are counted as converted (the worker's count, summary.json
  `float8`, is exact); a model whose matmul parameters are unknown counts all of its FLOPs.
- Peaks: MFU's basis (`peak_flops_per_device`) is the float8 peak (`hardware.peak_tflops.fp8`, or `mxfp8`),
  the precision the converted matmuls run in, as torchtitan reports it; `peak_flops_per_device_bf16` is
  hardware.precision's beside it, so a float8 run compares with a bf16 one (`perf/mfu_bf16_peak`).
  Emulated float8 (CPU, `float8.emulate=true`) runs its matmuls in high precision: hardware.precision's peak.
- Step time: the converted layers' 6 x params FLOPs per token at the float8 peak, the rest (attention's
  12*L*H*Q*T, the head) at hardware.precision's: `compute_speedup` = P_eff / P_bf16 with
  1 / P_eff = share / P_fp8 + (1 - share) / P_bf16, which `loom plan --compare` multiplies its rate by.
  The casts' own cost is not modelled (torch.compile fuses them; without it float8 gains little: a warning).
- Memory: the float8 copy of one block's converted weights, cast in forward and backward (1 byte per
  parameter, transient: torchao saves the high-precision weight and input for backward, not the casts).
- Wire: under `float8.all_gather` (tensorwise, FSDP2 sharded: `loom.float8.all_gather_active`) FSDP2
  all-gathers the converted weights in 1 byte instead of the policy's 2 (bf16); the head, norms and
  embeddings stay at 2.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom import float8
from loom.hardware.peaks import peak_flops, precision_key
from loom.layout import ParallelLayout
from loom.models import layer_count, model_width, vocab_size
from loom.models.heads import head_of
from loom.models.spec import ModelSpec

HEAD_MODULES = ("lm_head", "score")  # the output heads' module names in Loom's families (and transformers')
FLOAT8_BYTES = 1.0


def converted_params(cfg: DictConfig, spec: ModelSpec) -> float | None:
    """Parameters in the Linear layers torchao converts: the matmul parameters less the skipped head
    (None: the model's matmul parameters are unknown)."""
    if spec.matmul_params is None:
        return None
    skipped = any(str(s).split(".")[-1] in HEAD_MODULES for s in cfg.float8.skip)
    head = (head_of(cfg.model).outputs or vocab_size(cfg)) * model_width(cfg) if skipped else 0
    return float(max(0, spec.matmul_params - head))


def flops_share(spec: ModelSpec, converted: float | None) -> float:
    """The share of the training FLOPs in converted layers (6 x params per token); 1.0 when unknown."""
    if converted is None or not spec.flops_per_token:
        return 1.0
    return min(1.0, 6.0 * converted / spec.flops_per_token)


def peaks(cfg: DictConfig) -> tuple[float | None, float | None, str | None]:
    """(MFU's peak, hardware.precision's peak when float8 is on (else None), the key MFU's peak is)."""
    hw = cfg.hardware
    base, key = peak_flops(hw), float8.peak_key(cfg)
    if key is None:  # no float8, or emulated: the matmuls run in hardware.precision
        return base, (base if float8.enabled(cfg) else None), precision_key(hw)
    value = (hw.get("peak_tflops") or {}).get(key)
    return (float(value) * 1e12 if value else None), base, key


def compute_speedup(share: float, fp8_peak: float | None, bf16_peak: float | None) -> float:
    """P_eff / P_bf16 for `share` of the FLOPs at `fp8_peak` (1.0 when either peak is unknown)."""
    if not fp8_peak or not bf16_peak:
        return 1.0
    return 1.0 / (share * bf16_peak / fp8_peak + (1.0 - share))


def cast_bytes(cfg: DictConfig, converted: float | None, layout: ParallelLayout) -> float:
    """Device bytes of the transient float8 weight copies: one block's converted weights at 1 byte."""
    if not float8.enabled(cfg) or not converted:
        return 0.0
    return FLOAT8_BYTES * converted / max(1, layer_count(cfg)) / (layout.tp * layout.pp)


def wire_adjusted(cfg: DictConfig, layout: ParallelLayout, comm: dict[str, float], params: float,
                  converted: float | None, param_wire_bytes: float) -> dict[str, float]:
    """`comm` with FSDP2's all-gather of the converted weights at 1 byte per element (all_gather_active)."""
    if not comm.get("all_gather") or not params or not float8.all_gather_active(cfg, layout):
        return comm
    share = min(1.0, (params if converted is None else converted) / params)
    saved = share * (1.0 - FLOAT8_BYTES / param_wire_bytes) if param_wire_bytes > FLOAT8_BYTES else 0.0
    return {**comm, "all_gather": comm["all_gather"] * (1.0 - saved)}


def float8_summary(cfg: DictConfig, layout: ParallelLayout, spec: ModelSpec,
                   peak_pair: tuple[float | None, float | None, str | None]) -> dict[str, Any] | None:
    """plan.json `float8` (None: float8=none)."""
    if not float8.enabled(cfg):
        return None
    f8, (peak, bf16_peak, key) = cfg.float8, peak_pair
    converted = converted_params(cfg, spec)
    share = flops_share(spec, converted)
    emulated = float8.emulated(cfg)
    return {
        "recipe": str(f8.name), "emulated": emulated,
        "all_gather": float8.all_gather_active(cfg, layout), "all_gather_requested": bool(f8.all_gather),
        "peak_precision": key, "skip": [str(s) for s in f8.skip], "auto_filter": bool(f8.auto_filter),
        "converted_params": converted, "flops_share": share,
        "compute_speedup": 1.0 if emulated else compute_speedup(share, peak, bf16_peak),
        "cast_bytes_per_device": cast_bytes(cfg, converted, layout),
    }


def float8_warnings(cfg: DictConfig, layout: ParallelLayout) -> list[str]:
    """What is accepted but worth saying once: no compile on a GPU, emulation on a GPU, an all-gather flag
    the strategy ignores."""
    if not float8.enabled(cfg):
        return []
    f8, hw, out = cfg.float8, cfg.hardware, []
    gpu = hw.accelerator == "gpu"
    if gpu and float8.emulated(cfg):
        out.append(f"float8={f8.name} with float8.emulate=true on hardware={hw.name} ({hw.device_name}): the "
                   "float8 numerics are emulated in high precision, no speedup (MFU against the "
                   f"{hw.precision} peak); leave float8.emulate=null for real float8 matmuls.")
    elif gpu and not cfg.trainer.get("compile", False):
        out.append(f"float8={f8.name} without trainer.compile=true: torchao's casts and scalings run as separate "
                   "kernels, and float8 is usually no faster than bf16 without torch.compile fusing them "
                   "(torchtitan #1191, torchao #2262); set trainer.compile=true.")
    if f8.all_gather and f8.name in float8.ALL_GATHER_RECIPES and not float8.all_gather_active(cfg, layout):
        out.append(f"float8.all_gather=true has no effect with strategy={cfg.strategy.name} here: only FSDP2 "
                   "with sharded weights (dp_shard x cp > 1) all-gathers them; ignored (plan.json "
                   "float8.all_gather: false).")
    return out


def float8_line(f8: dict[str, Any]) -> str:
    """`loom plan`'s float8 row."""
    how = "emulated (torchao emulate=True: float8 numerics, high-precision matmuls)" if f8["emulated"] \
        else f"real float8 matmuls, MFU against the {f8['peak_precision']} peak"
    conv = f8.get("converted_params")
    line = f"{f8['recipe']}, {how}; " + (f"{conv / 1e6:,.1f}M params in converted Linear layers, " if conv else "") \
        + f"{f8['flops_share']:.0%} of FLOPs"
    if not f8["emulated"] and f8["compute_speedup"] != 1.0:
        line += f" (compute rate x{f8['compute_speedup']:.2f} in the step estimate)"
    if f8["all_gather"]:
        line += "; FSDP2 all-gathers them in float8 (1 byte/param)"
    return line + f"; {f8['cast_bytes_per_device'] / 1e9:,.2f} GB transient float8 weight copies per device"
