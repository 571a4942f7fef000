"""float8's checks (torch-free, before anything launches): each refusal is one paragraph naming the fix.

- the recipe's options: `float8.all_gather=true` with a recipe other than tensorwise (torchao asserts it);
- the hardware: real float8 matmuls need compute capability 8.9+ (H100, H200, L40S, RTX 4090, B200), MXFP8
  Blackwell (10.0+). A GPU is known by `hardware.device_name` in `hardware.peaks.GPU_PEAKS`; a device the
  table does not know needs `hardware.peak_tflops.fp8` (or `mxfp8`) from its datasheet, which says it has
  them. On CPU (and with `float8.emulate=true`) torchao emulates: allowed, no speedup;
- the strategy: what can carry torchao's Float8Linear (`STRATEGY_PROBLEMS`, by the registry's
  `mixed_precision` mechanism, and the layout's degrees). single, ddp and fsdp (FSDP2, context parallelism
  included) train it; DeepSpeed ZeRO and pipelines are refused, tensor parallelism is not built yet.
Model families need nothing: every Loom family (and `model=custom`, `mlp`, `hf_causal_lm`) computes its
projections in nn.Linear, which is what torchao converts; a model without one trains unconverted.
"""

from __future__ import annotations

from omegaconf import DictConfig

from loom import strategies
from loom.errors import ConfigError
from loom.float8.rules import ALL_GATHER_RECIPES, PEAK_KEYS, emulated, enabled
from loom.hardware.peaks import lookup
from loom.layout import ParallelLayout

# Compute capability each peak key's matmuls need (torch's `_scaled_mm`: 8.9; MX block scales: 10.0).
CAPABILITY = {"fp8": (8, 9), "mxfp8": (10, 0)}
CAPABLE = {"fp8": "H100, H200, L40S, RTX 4090, B200", "mxfp8": "B200 (Blackwell)"}
ELSEWHERE = {"fp8": "a profile with such a GPU (e.g. hardware=h100x8)", "mxfp8": "a Blackwell GPU's profile"}
EMULATE_FIX = "float8.emulate=true (torchao's emulation: the numerics of float8, no speedup)"

# A strategy's mixed-precision mechanism (strategies.registry `mixed_precision`) that cannot carry
# float8, and why.
STRATEGY_PROBLEMS = {
    "deepspeed": ("DeepSpeed ZeRO flattens the parameters into its own fp32/bf16 partition buffers and steps "
                  "those, so torchao's Float8Linear weights lose their scaling path (the float8 casts and their "
                  "amax bookkeeping see ZeRO's flat views, not the layers' weights); not built"),
}
# Layout degrees whose float8 path is not built, and why.
DEGREE_PROBLEMS = {
    "pp": "pipeline stages (torch.distributed.pipelining) around torchao's Float8Linear are not built",
    "tp": ("tensor parallelism needs torchao's float8 tensor-parallel styles (Float8ColwiseParallel, "
           "Float8RowwiseParallel) in the model's TP plan; not built yet"),
}
ALLOWED_STRATEGIES = "strategy=single, ddp or fsdp (tp=1, pp=1)"


def check_float8(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Refuse what cannot train in float8 (nothing to check for float8=none)."""
    if not enabled(cfg):
        return
    _check_all_gather(cfg)
    _check_strategy(cfg, layout)
    _check_hardware(cfg)


def strategy_refused(cfg: DictConfig, name: str) -> bool:
    """Whether float8 refuses strategy `name` whatever its degrees (`loom plan`'s suggestions skip it)."""
    return enabled(cfg) and strategies.option(name).mixed_precision in STRATEGY_PROBLEMS


def _check_all_gather(cfg: DictConfig) -> None:
    f8 = cfg.float8
    if f8.all_gather and f8.name not in ALL_GATHER_RECIPES:
        raise ConfigError(
            f"Invalid config: float8.all_gather=true with float8={f8.name}: FSDP2's float8 all-gather sends one "
            f"scale per tensor, which only the {'/'.join(ALL_GATHER_RECIPES)} recipe has (torchao asserts it). "
            f"Set float8.all_gather=false, or use float8=tensorwise.")


def _check_strategy(cfg: DictConfig, layout: ParallelLayout) -> None:
    name = cfg.strategy.name
    why = STRATEGY_PROBLEMS.get(strategies.option(name).mixed_precision)
    degree = next((d for d in DEGREE_PROBLEMS if int(getattr(layout, d)) > 1), None)
    if why is None and degree is None:
        return
    if why is None:
        why = f"{degree}={getattr(layout, degree)}: {DEGREE_PROBLEMS[degree]}"
    raise ConfigError(
        f"Invalid config: float8={cfg.float8.name} with strategy={name}: {why}. Train float8 with "
        f"{ALLOWED_STRATEGIES} (FSDP2 shards the float8 layers and, under tensorwise, all-gathers them in "
        f"float8), or set float8=none to keep strategy={name}.")


def _check_hardware(cfg: DictConfig) -> None:
    hw, name = cfg.hardware, cfg.float8.name
    if hw.accelerator != "gpu" or emulated(cfg):
        return  # CPU: torchao's emulation; a GPU with float8.emulate=true: the same (a plan warning)
    key = PEAK_KEYS[name]
    need = CAPABILITY[key]
    row = lookup(str(hw.device_name))
    where = f"hardware={hw.name} ({hw.device_name}"
    if row is not None and tuple(row.cc) < need:
        has = (" has float8 matmuls but not MXFP8's block-scaled ones: use float8=tensorwise or float8=rowwise,"
               if key == "mxfp8" and tuple(row.cc) >= CAPABILITY["fp8"] else
               f" has no {'MXFP8' if key == 'mxfp8' else 'float8'} matmuls: use float8=none,")
        raise ConfigError(
            f"Invalid config: float8={name} on {where}, compute capability {row.cc[0]}.{row.cc[1]}): "
            f"{_needs(key)}; this GPU{has} {ELSEWHERE[key]}, or {EMULATE_FIX}.")
    declared = (hw.get("peak_tflops") or {}).get(key)
    if row is None and not declared:
        old = "" if hw.get("bf16_supported", True) else " (hardware.bf16_supported=false: pre-Ampere, no float8)"
        raise ConfigError(
            f"Invalid config: float8={name} on {where}){old}: {_needs(key)}, and Loom's datasheet table "
            f"(hardware.peaks.GPU_PEAKS) does not know this device. If it has them, set "
            f"hardware.peak_tflops.{key}=<dense TFLOP/s from its datasheet>; otherwise use float8=none "
            f"or {EMULATE_FIX}.")


def _needs(key: str) -> str:
    cc = CAPABILITY[key]
    what = "MXFP8 (block-scaled float8) matmuls" if key == "mxfp8" else "float8 matmuls (torch's _scaled_mm)"
    return f"real {what} need compute capability {cc[0]}.{cc[1]}+ ({CAPABLE[key]})"
