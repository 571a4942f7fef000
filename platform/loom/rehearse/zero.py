"""ZeRO strategies in the rehearsal: DeepSpeed cannot initialize over a fake process group,
so the model states per device come from DeepSpeed's own estimators, beside Loom's plan:
`estimate_zero2_model_states_mem_needs` (zero1 and zero2: DeepSpeed has no stage-1 one) and
`estimate_zero3_model_states_mem_needs` (what `estimate_zero3_model_states_mem_needs_all_cold`
prints, for zero3 and zero3_offload). Both count mixed-precision Adam (16-bit params and
grads, fp32 master, m and v) with `additional_buffer_factor` 1.0 (no headroom added)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.plan.memory import largest_param
from loom.strategies.deepspeed_config import zero_stage

SIXTEEN_BIT = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")  # what the estimators assume


def _quiet_import():
    """DeepSpeed's estimators (importing deepspeed logs its accelerator choice: kept quiet)."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def zero_rehearsal(cfg: DictConfig, plan: dict[str, Any], layout: ParallelLayout) -> dict[str, Any]:
    """plan.json `rehearsal` for zero*: DeepSpeed's model-state bytes per device vs the plan's."""
    zero2, zero3 = _quiet_import()
    s, P = cfg.strategy, int(plan["params"] or 0)
    per_node, nodes = layout.devices_per_node, layout.num_nodes
    offload = bool(s.get("offload_optimizer", False))
    if zero_stage(s.name) == 3:
        host, device, _ = zero3(P, int(largest_param(cfg)), per_node, nodes, cpu_offload=offload,
                                cpu_offload_params=bool(s.get("offload_params", False)), zero_init=True,
                                additional_buffer_factor=1.0)
        name = "estimate_zero3_model_states_mem_needs (behind ..._all_cold)"
    else:
        host, device = zero2(P, per_node, nodes, cpu_offload=offload, additional_buffer_factor=1.0)
        name = "estimate_zero2_model_states_mem_needs"
    mem = plan["memory_per_device_bytes"]
    planned = float(mem["params"] + mem["grads"] + mem["optimizer"])
    precision = str(cfg.hardware.precision)
    note = None if precision in SIXTEEN_BIT else (
        f"DeepSpeed's estimators count 16-bit mixed precision; this run is {precision} (fp32 weights and "
        "gradients), so the plan's larger figure is expected, not an error")
    return {"method": "DeepSpeed's estimators", "estimator": f"DeepSpeed {name}", "note": note,
            "world_size": layout.world, "planned_states": planned, "deepspeed_states": float(device),
            "deepspeed_host": float(host), "difference": (planned - device) / device if device else None,
            "ranks": []}
