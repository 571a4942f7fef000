"""The bandwidth the plan reckons communication at (torch-free): `loom probe`'s measured bus
bandwidth, else the hardware profile's interconnect figure (the inter-node one across nodes),
else a fallback per accelerator. Used by `plan --compare`'s step time and the plan's exposed
all-to-all of expert parallelism (plan.experts)."""

from __future__ import annotations

import re

from omegaconf import DictConfig

FALLBACK_GBPS = {"gpu": 25.0, "cpu": 2.0}       # GB/s, when the interconnect names no figure
_FIGURE = re.compile(r"(\d+(?:\.\d+)?)\s*(GB|Gb)/s")


def bandwidth(hw: DictConfig) -> tuple[float, str]:
    """GB/s per device for the communication term, and where it comes from."""
    measured = (hw.get("measured") or {}).get("allreduce_busbw_gbps") if hw.get("measured") else None
    if measured:
        return float(measured), f"measured all-reduce {float(measured):g} GB/s (loom probe)"
    text = str(hw.interconnect or "")
    parts = [p for p in text.split(",") if p.strip()]
    if int(hw.num_nodes) > 1:
        parts = [p for p in parts if "inter" in p] or []
    for part in parts:
        m = _FIGURE.search(part)
        if m:
            gbps = float(m.group(1)) / (8 if m.group(2) == "Gb" else 1)
            return gbps, f"{part.strip()} = {gbps:g} GB/s"
    gbps = FALLBACK_GBPS.get(str(hw.accelerator), FALLBACK_GBPS["gpu"])
    return gbps, f"assumed {gbps:g} GB/s (interconnect {text or 'unknown'} names no figure)"
