"""Hardware profiles: resolve `auto` and check a profile against this machine.

Runs in the launcher before torch is imported, so GPUs are counted through NVML
(nvidia-ml-py), which answers in milliseconds, not through torch.cuda.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from loom.config import ConfigError


def visible_gpus() -> int:
    """Number of NVIDIA GPUs this process may use (NVML, honouring CUDA_VISIBLE_DEVICES)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))
    return count


def auto_overrides(overrides: list[str]) -> list[str]:
    """Overrides that turn `hardware=auto` into a concrete profile for this machine.

    The concrete profile comes first so the user's own `hardware.*` overrides still win.
    """
    gpus = visible_gpus()
    rest = [o for o in overrides if not o.startswith("hardware=")]
    if gpus:
        return ["hardware=gpu", f"hardware.devices={gpus}", *rest]
    return ["hardware=cpu", *rest]


def user_set(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def check_machine(cfg: DictConfig) -> None:
    """Refuse a profile this machine cannot run (exit 2 before any process starts)."""
    hw = cfg.hardware
    if hw.accelerator == "gpu" and hw.num_nodes == 1:
        have = visible_gpus()
        if have == 0:
            raise ConfigError(
                f"Invalid config: hardware={hw.name} needs CUDA GPUs but this machine has none "
                "visible to NVML. Use hardware=cpu (or hardware=auto) here."
            )
        if hw.devices > have:
            raise ConfigError(
                f"Invalid config: hardware.devices={hw.devices} but this machine has {have} GPU(s). "
                f"Set hardware.devices<={have}."
            )
