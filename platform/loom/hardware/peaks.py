"""Datasheet peaks and MFU: never a guess (no peak for the precision in use: MFU is null).

`GPU_PEAKS` holds dense (no sparsity) Tensor Core peaks per device, TFLOP/s: datasheets print
the sparse figure with an asterisk, half of it is the dense one. `fp8` is the FP8 Tensor Core peak
(compute capability 8.9+: torch's `_scaled_mm`, what torchao's float8 training runs on; None: the
device has no float8 matmuls), `mxfp8` the MXFP8 block-scaled peak (Blackwell, 10.0+; None: none).
A device is found by its NVML/torch name *and* compute capability; an unknown name gets no peak (never borrowed from a
neighbour: a wrong peak is how MFU above 100% gets reported).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

PRECISION_KEY = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


@dataclass(frozen=True)
class GpuPeak:
    names: tuple[str, ...]      # exact device names, as NVML and torch.cuda.get_device_name print them
    cc: tuple[int, int]         # compute capability
    bf16: float
    fp16: float
    tf32: float
    fp32: float
    memory_gb: float
    fp8: float | None = None    # FP8 Tensor Core, dense (None: no float8 matmuls)
    mxfp8: float | None = None  # MXFP8 (block-scaled FP8), dense (None: no MX matmuls)

    def tflops(self) -> dict[str, float]:
        """The `hardware.peak_tflops` entries of this device (a precision it lacks is left out)."""
        out = {"bf16": self.bf16, "fp16": self.fp16, "tf32": self.tf32, "fp32": self.fp32}
        return {**out, **{k: v for k, v in (("fp8", self.fp8), ("mxfp8", self.mxfp8)) if v is not None}}


# (H100) below: the H100 Tensor Core GPU datasheet,
# resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # H100 SXM5: H100 datasheet (H100), BF16/FP16 1,979*, TF32 989*, FP32 67, FP8 3,958* (* sparse)
    GpuPeak(("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"), (9, 0), 989.4, 989.4, 494.7, 66.9, 80, fp8=1978.9),
    # H100 PCIe: H100 datasheet (H100), BF16/FP16 1,513*, TF32 756*, FP32 51, FP8 3,026*
    GpuPeak(("NVIDIA H100 PCIe",), (9, 0), 756.5, 756.5, 378.0, 51.2, 80, fp8=1513.0),
    # H100 NVL (per GPU): H100 datasheet (H100), BF16/FP16 1,671*, TF32 835*, FP32 60, FP8 3,341*
    GpuPeak(("NVIDIA H100 NVL",), (9, 0), 835.5, 835.5, 417.5, 60.0, 94, fp8=1670.5),
    # H200 SXM: H200 datasheet (nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446),
    # BF16/FP16 1,979*, TF32 989*, FP32 67, FP8 3,958*
    GpuPeak(("NVIDIA H200",), (9, 0), 989.4, 989.4, 494.7, 67.0, 141, fp8=1978.9),
    # H200 NVL: same H200 datasheet, BF16/FP16 1,671*, TF32 835*, FP32 60, FP8 3,341*
    GpuPeak(("NVIDIA H200 NVL",), (9, 0), 835.5, 835.5, 417.5, 60.0, 141, fp8=1670.5),
    # H800 SXM5 / PCIe: NVIDIA H800 datasheet (export variant of H100: same compute, NVLink 400 GB/s),
    # SXM BF16/FP16 1,979*, TF32 989*, FP32 67, FP8 3,958*; PCIe 1,513*, 756*, 51, FP8 3,026*
    GpuPeak(("NVIDIA H800", "NVIDIA H800 80GB HBM3"), (9, 0), 989.4, 989.4, 494.7, 66.9, 80, fp8=1978.9),
    GpuPeak(("NVIDIA H800 PCIe",), (9, 0), 756.5, 756.5, 378.0, 51.2, 80, fp8=1513.0),
    # GH200: NVIDIA GH200 Grace Hopper Superchip datasheet, GPU: BF16/FP16 990 | 1,979*,
    # TF32 494 | 989*, FP32 67, FP8 1,979 | 3,958*
    GpuPeak(("NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e", "NVIDIA GH200 96GB HBM3"), (9, 0),
            989.4, 989.4, 494.7, 67.0, 96, fp8=1978.9),
    # A100 SXM4 and PCIe, 40 and 80 GB: A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/
    # Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16/FP16 312,
    # TF32 156, FP32 19.5 (dense; 624*/312* sparse); no FP8 (Ampere, 8.0: fp8 None)
    GpuPeak(("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB"), (8, 0),
            312.0, 312.0, 156.0, 19.5, 80),
    GpuPeak(("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), (8, 0), 312.0, 312.0, 156.0, 19.5, 40),
    # L40S: L40S datasheet (resources.nvidia.com/en-us-l40s/l40s-datasheet-28413): BF16/FP16
    # 362.05 | 733*, TF32 183 | 366*, FP32 91.6, FP8 733 | 1,466* (the datasheet's FP8 is twice its BF16)
    GpuPeak(("NVIDIA L40S",), (8, 9), 362.05, 362.05, 183.0, 91.6, 48, fp8=733.0),
    # A10G (AWS G5): NVIDIA publishes no A10G datasheet; the A10 datasheet (same GA102, cc 8.6;
    # nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf): BF16/FP16
    # 125 | 250*, TF32 62.5 | 125*, FP32 31.2. The A10G clocks lower: MFU reads low, never high. No FP8 (8.6).
    GpuPeak(("NVIDIA A10G",), (8, 6), 125.0, 125.0, 62.5, 31.2, 24),
    # RTX 4090: Ada architecture whitepaper v2.1, appendix A (images.nvidia.com/aem-dam/Solutions/
    # Data-Center/l4/nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf): FP16/BF16 Tensor with FP32
    # accumulate (what mixed precision uses) 165.2 | 330.4*, TF32 82.6 | 165.2*, FP32 82.6; FP8 with FP32
    # accumulate (what `_scaled_mm` uses) 330.3 | 660.6*
    GpuPeak(("NVIDIA GeForce RTX 4090",), (8, 9), 165.2, 165.2, 82.6, 82.6, 24, fp8=330.3),
    # B200 (HGX B200, per GPU): NVIDIA Blackwell/HGX B200 datasheet (nvidia.com/en-us/data-center/hgx):
    # 8 GPUs FP16/BF16 36 PF*, TF32 18 PF*, FP32 600 TF -> per GPU dense 2,250 / 1,125 / 75; FP8/FP6
    # 72 PF* -> 4,500 dense per GPU; MXFP8 runs on the same FP8 Tensor Cores (block scales): 4,500
    GpuPeak(("NVIDIA B200",), (10, 0), 2250.0, 2250.0, 1125.0, 75.0, 180, fp8=4500.0, mxfp8=4500.0),
)


def lookup(name: str | None, cc: tuple[int, int] | None = None) -> GpuPeak | None:
    """The table row of a device by its exact name; a compute capability that disagrees with the
    row (a renamed or virtualized device) means no row. None: peak unknown, MFU null."""
    if not name:
        return None
    for row in GPU_PEAKS:
        if name.strip() in row.names and (cc is None or tuple(cc) == row.cc):
            return row
    return None


def bf16_capable(cc: tuple[int, int] | None) -> bool:
    """bf16 Tensor Cores need compute capability 8.0 (Ampere) or later: V100 (7.0), T4 (7.5) lack it."""
    return cc is not None and tuple(cc) >= (8, 0)


def precision_key(hw: DictConfig) -> str | None:
    """Which `peak_tflops` key the run's matmuls reach: fp32 runs on a GPU with `hardware.tf32`
    run at the TF32 peak where the profile has one."""
    key = PRECISION_KEY.get(hw.precision)
    tf32_peak = (hw.get("peak_tflops") or {}).get("tf32")
    if key == "fp32" and hw.get("accelerator") == "gpu" and hw.get("tf32", True) and tf32_peak:
        return "tf32"
    return key


def peak_flops(hw: DictConfig) -> float | None:
    """The profile's datasheet peak for the precision in use, in FLOP/s, or None (MFU is
    then null). Never a guess: no key for the precision means unknown."""
    key = precision_key(hw)
    value = (hw.get("peak_tflops") or {}).get(key) if key else None
    return float(value) * 1e12 if value else None


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilization per device: achieved FLOP/s / (peak x devices); None when the peak
    is unknown. A value > 1 is returned as is: `mfu_error` turns it into the error to report."""
    if not peak or world < 1:
        return None
    return tokens_per_sec * flops_per_token / (peak * world)


def mfu_error(value: float | None, peak: float | None) -> str | None:
    """The error for an impossible MFU (> 1: the run beat the profile's peak, so the peak is
    wrong, not the run), naming the peak; None when the value is possible or unknown."""
    if value is None or not peak or value <= 1.0:
        return None
    return (f"MFU {value:.2f} > 1: the achieved {value * peak / 1e12:,.1f} TFLOP/s per device exceeds "
            f"the profile's peak {peak / 1e12:,.1f} TFLOP/s (hardware.peak_tflops for this precision): "
            "the peak is wrong for this device; set it from the datasheet (dense, not sparse)")
