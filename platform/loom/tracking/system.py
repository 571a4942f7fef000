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

log = logging.getLogger("loom")

ZEROS = {"util": 0.0, "mem_gb": 0.0, "power_w": 0.0}


def pci_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The PCI address as NVML's `nvmlDeviceGetHandleByPciBusId` takes it: domain:bus:device.function
    in hex, 8 digits of domain (NVML's `busIdLegacy` has 4; both are accepted, 8 is the current one)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def nvml_uuid(torch_uuid: Any) -> str | None:
    """torch's device UUID (`props.uuid`, printed without a prefix) as NVML spells it ("GPU-...");
    MIG UUIDs keep their "MIG-" prefix."""
    text = str(torch_uuid or "").strip()
    if not text:
        return None
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def visible_entry(index: int, visible: str | None) -> tuple[str, str | int] | None:
    """The CUDA_VISIBLE_DEVICES entry of torch device `index`: ("index", physical NVML index) or
    ("uuid", "GPU-..."); None when the variable is unset (torch index = NVML index) or too short."""
    if visible is None:
        return ("index", index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    # CUDA stops at the first invalid entry (e.g. -1): later ones are not visible.
    valid: list[str] = []
    for e in entries:
        if e.lstrip("-").isdigit() and int(e) < 0:
            break
        valid.append(e)
    if index >= len(valid):
        return None
    entry = valid[index]
    if entry.isdigit():
        return ("index", int(entry))
    return ("uuid", entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}")


def nvml_targets(index: int, visible: str | None, uuid: Any = None,
                 pci: tuple[int, int, int] | None = None) -> list[tuple[str, str | int]]:
    """NVML identifiers of torch device `index`, best first: UUID, PCI bus id string, the
    CUDA_VISIBLE_DEVICES entry. `pci` is (pci_domain_id, pci_bus_id, pci_device_id) from torch."""
    targets: list[tuple[str, str | int]] = []
    u = nvml_uuid(uuid)
    if u:
        targets.append(("uuid", u))
    if pci is not None:
        targets.append(("pci", pci_bus_id(*pci)))
    entry = visible_entry(index, visible)
    if entry is not None and entry not in targets:
        targets.append(entry)
    return targets


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
