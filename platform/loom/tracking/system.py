"""GPU utilization, memory and power through NVML; zeros where there is no GPU."""

from __future__ import annotations

import torch


class GpuStats:
    def __init__(self) -> None:
        self.available = False
        self._handles: dict[int, object] = {}
        if not torch.cuda.is_available():
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.available = True
        except Exception:
            self.available = False

    def _handle(self, index: int):
        if index not in self._handles:
            # NVML numbers physical devices; map through CUDA_VISIBLE_DEVICES via the PCI bus id.
            bus_id = torch.cuda.get_device_properties(index).pci_bus_id
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return self._handles[index]

    def sample(self, device: torch.device) -> dict[str, float]:
        if not self.available or device.type != "cuda":
            return {"util": 0.0, "mem_gb": 0.0, "power_w": 0.0}
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            h = self._handle(index)
            util = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            power = self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except Exception:
            util, power = 0.0, 0.0
        return {"util": util, "mem_gb": torch.cuda.memory_reserved(index) / 2**30, "power_w": power}
