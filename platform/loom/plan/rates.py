"""The FLOP/s a device computes at, for the plan's time estimates (`loom plan --compare`'s step, the
evaluation cost): a `loom probe` measurement, else the datasheet peak x PEAK_EFFICIENCY, else an assumed figure."""

from __future__ import annotations

from omegaconf import DictConfig

PEAK_EFFICIENCY = 0.4          # model FLOPs utilisation a well-tuned dense run reaches of the datasheet peak
FALLBACK_TFLOPS = {"gpu": 100.0, "cpu": 0.05}   # per device, when neither peak nor a probe is known


def compute_rate(hw: DictConfig, peak: float | None) -> tuple[float, str]:
    """FLOP/s per device the compute term divides by, and where it comes from."""
    measured = (hw.get("measured") or {}).get("matmul_tflops") if hw.get("measured") else None
    if measured:
        return float(measured) * 1e12, f"measured matmul {float(measured):g} TFLOP/s (loom probe)"
    if peak is None:
        from loom.hardware.peaks import peak_flops

        peak = peak_flops(hw)
    if peak:
        return peak * PEAK_EFFICIENCY, f"peak {peak / 1e12:g} TFLOP/s x {PEAK_EFFICIENCY:g}"
    tf = FALLBACK_TFLOPS.get(str(hw.accelerator), FALLBACK_TFLOPS["gpu"])
    return tf * 1e12, f"assumed {tf:g} TFLOP/s (no peak, no `loom probe` profile)"
