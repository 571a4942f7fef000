"""Datasheet peaks and MFU: never a guess (no peak for the precision in use: MFU is null)."""

from __future__ import annotations

from omegaconf import DictConfig

PRECISION_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


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
