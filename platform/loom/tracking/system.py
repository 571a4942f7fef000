"""GPU utilization, memory and power through NVML; zeros where there is no GPU.

NVML numbers the physical devices while torch numbers the visible ones, so a torch index is
turned into NVML identifiers by pure functions (testable without a GPU): torch's UUID first
(exact, whatever CUDA_VISIBLE_DEVICES says), then the PCI bus id *string* NVML expects
("00000000:1B:00.0"; torch's `pci_bus_id` is only the bus number, an int), then the
CUDA_VISIBLE_DEVICES entry (an index or a UUID). Any NVML failure degrades to "no GPU
utilization" with one warning: telemetry never stops a run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from loom.hardware.nvml import nvml_targets

log = logging.getLogger("loom")

ZEROS = {"util": 0.0, "mem_gb": 0.0, "power_w": 0.0}


def open_nvml() -> Any | None:
    """pynvml, initialized; None (and one warning) when NVML cannot start."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as e:  # no driver, no library, no permission: run on without utilization
        log.warning(f"NVML unavailable ({type(e).__name__}: {e}): GPU utilization and power not recorded")
        return None


class GpuStats:
    """Per-device NVML sampling for the Recorder; `available` is False once NVML has failed."""

    def __init__(self, cuda: bool | None = None) -> None:
        self._handles: dict[int, Any] = {}
        self._nvml = open_nvml() if (torch.cuda.is_available() if cuda is None else cuda) else None
        self.available = self._nvml is not None

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            props = torch.cuda.get_device_properties(index)
            pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
            targets = nvml_targets(index, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                   getattr(props, "uuid", None), pci)
            self._handles[index] = self._first_handle(targets)
        return self._handles[index]

    def _first_handle(self, targets: list[tuple[str, str | int]]) -> Any:
        get = {"uuid": self._nvml.nvmlDeviceGetHandleByUUID,
               "pci": self._nvml.nvmlDeviceGetHandleByPciBusId,
               "index": self._nvml.nvmlDeviceGetHandleByIndex}
        errors = []
        for kind, value in targets:
            try:
                return get[kind](value)
            except Exception as e:
                errors.append(f"{kind} {value!r}: {e}")
        raise RuntimeError("; ".join(errors) or "no NVML identifier")

    def _disable(self, err: Exception) -> None:
        log.warning(f"NVML failed ({err}): GPU utilization and power not recorded from here on")
        self.available = False

    def sample(self, device: torch.device) -> dict[str, float]:
        if not self.available or device.type != "cuda":
            return dict(ZEROS)
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            h = self._handle(index)
            util = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            power = self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except Exception as e:
            self._disable(e)
            return dict(ZEROS)
        return {"util": util, "mem_gb": torch.cuda.memory_reserved(index) / 2**30, "power_w": power}
