"""Which NVML device a CUDA device is: pure functions of the numbers and strings torch and
CUDA_VISIBLE_DEVICES give (torch-free, so `hardware=auto` uses them too; tested without a GPU).

NVML numbers the physical devices while CUDA numbers the visible ones. NVML's
`nvmlDeviceGetHandleByPciBusId` takes a string ("00000000:1B:00.0"); torch's `pci_bus_id` is
only the bus number, an int (passing it made NVML read memory at that address).
"""

from __future__ import annotations

from typing import Any


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


def visible_count(visible: str | None, physical: int) -> int:
    """How many of `physical` NVML devices CUDA_VISIBLE_DEVICES leaves visible."""
    if visible is None:
        return physical
    n = 0
    while visible_entry(n, visible) is not None:
        n += 1
    return min(n, physical)
