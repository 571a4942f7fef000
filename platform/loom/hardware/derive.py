"""`hardware.accelerator=cpu` on a GPU profile: the device fields follow the accelerator.

A GPU profile (h100x8, multinode, slurm, ...) overridden with `hardware.accelerator=cpu` runs
its ranks as CPU processes, so its GPU facts no longer describe the run: an H100's peak, the
nccl backend, 80 GB of device memory, the DGX's 2 TB of host memory. They are re-derived, never
shown next to a CPU accelerator: every device field the user did not set on the command line
takes the `cpu` profile's value (gloo, fp32, peak unknown, no device memory, this machine's
host memory and cores as conf/hardware/cpu.yaml states them). The layout (devices, num_nodes,
rendezvous, SLURM block, restarts) stays the profile's. A CPU profile (accelerator: cpu in its
yaml, e.g. one written by `loom probe`) is left as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

# Fields that describe the device rather than the layout: re-derived from the cpu profile.
DEVICE_FIELDS = ("backend", "precision", "device_name", "device_memory_gb", "bf16_supported", "peak_tflops",
                 "host_memory_gb", "cpu_cores", "interconnect", "dataloader_workers", "pin_memory", "measured")


def profile_accelerator(hardware_dir: Path, name: str, depth: int = 0) -> str | None:
    """The accelerator a profile's yaml (or the profile it extends via `defaults`) declares;
    None when the profile is not a file of `hardware_dir`."""
    path = hardware_dir / f"{name}.yaml"
    if depth > 8 or not path.is_file():
        return None
    data: Any = OmegaConf.to_container(OmegaConf.load(path))
    if "accelerator" in data:
        return str(data["accelerator"])
    for entry in data.get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":
            found = profile_accelerator(hardware_dir, entry, depth + 1)
            if found:
                return found
    return "cpu"  # the schema's default


def rederive_for_cpu(hw: DictConfig, hardware_dir: Path, user_keys: set[str]) -> list[str]:
    """Replace the GPU facts of a GPU profile run on `accelerator=cpu` (in place); returns the
    fields changed. `user_keys`: the `hardware.*` fields the user set (they win)."""
    if hw.get("accelerator") != "cpu" or profile_accelerator(hardware_dir, str(hw.get("name"))) != "gpu":
        return []
    cpu = OmegaConf.load(hardware_dir / "cpu.yaml")
    changed = []
    with open_dict(hw):
        for key in DEVICE_FIELDS:
            if key in user_keys:
                continue
            value = cpu.get(key)
            if isinstance(value, DictConfig):  # peak_tflops: the user's own entries win
                value = OmegaConf.merge(value, {k.partition(".")[2]: hw[key][k.partition(".")[2]]
                                                for k in user_keys if k.startswith(f"{key}.")})
            if key == "interconnect" and hw.get("num_nodes", 1) > 1:
                value = "unknown"  # loopback is one machine's
            if hw.get(key) != value:
                hw[key] = value
                changed.append(key)
    return changed
