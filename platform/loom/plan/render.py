"""`loom plan`'s table (rich), from the plan as plan.json holds it."""

from __future__ import annotations

from typing import Any

from loom.plan.memory import GB


def render(plan: dict[str, Any]) -> None:
    """The plan as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    mem = plan["memory_per_device_bytes"]
    bpp = plan["bytes_per_param"]
    t = Table(title=f"loom plan: {plan['strategy']} on {plan['hardware']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    hw = f"{plan['device_name']}, {plan['accelerator']}, {plan['backend']}, {plan['interconnect']}"
    if plan.get("resolved_from"):
        hw += f" (resolved from {plan['resolved_from']})"
    rows = [
        ("hardware", hw),
        ("world size", f"{plan['world_size']} ({plan['num_nodes']} node(s) x {plan['devices_per_node']}), "
                       f"dp={plan['data_parallel']} tp={plan['tensor_parallel']}"),
        ("batch", f"micro {plan['micro_batch']} x accum {plan['accumulate_grad_batches']} x dp "
                  f"{plan['data_parallel']} = global {plan['global_batch']} "
                  f"({plan['tokens_per_step']:,} tokens/step)"),
        ("model", (f"{plan['params'] / 1e6:,.1f}M params, " if plan["params"] is not None else "params unknown, ")
                  + (f"{plan['flops_per_token'] / 1e9:,.3f} GFLOP/token, {plan['flops_per_step'] / 1e12:,.2f} "
                     "TFLOP/step" if plan["flops_per_token"] is not None else "FLOPs unknown")),
        ("precision", f"{plan['precision']} ({bpp['params']:g}/{bpp['grads']:g}/{bpp['optimizer']:g} "
                      "bytes per param: params/grads/optimizer)"),
        ("params / grads / optim", f"{mem['params'] / GB:,.2f} / {mem['grads'] / GB:,.2f} / "
                                   f"{mem['optimizer'] / GB:,.2f} GB per device"),
        ("activations", f"{mem['activations'] / GB:,.2f} GB per device (micro batch {plan['micro_batch']})"),
    ]
    if mem["host_offload"]:
        rows.append(("offloaded to host", f"{mem['host_offload'] / GB:,.2f} GB per device"))
    cap = plan["capacity_per_device_bytes"]
    rows.append(("total", f"{mem['total'] / GB:,.2f} GB of "
                          + (f"{cap / GB:,.2f} GB" if cap is not None else "? GB")
                          + f" ({plan['capacity_source']})"))
    if plan["max_micro_batch"] is not None:
        rows.append(("max micro batch", f"{plan['max_micro_batch']} (activations permitting)"))
    comm = plan["comm_bytes_per_step_per_device"]
    detail = ", ".join(f"{k} {v / GB:,.3f}" for k, v in plan["comm_bytes_by_collective"].items() if v)
    line = f"{comm / GB:,.3f} GB per device per step" + (f" ({detail})" if detail else "")
    if plan["comm_time_s_at_measured_busbw"]:
        line += f", ~{plan['comm_time_s_at_measured_busbw']:.3f} s at the probed bus bandwidth"
    rows.append(("communication", line))
    peak = plan["peak_flops_per_device"]
    rows.append(("peak", f"{peak / 1e12:,.4g} TFLOP/s per device ({plan['precision']})" if peak
                 else "unknown (MFU will be null)"))
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    if not plan["fits"]:
        verdict += (f"; strategy={plan['suggestion']} would fit" if plan["suggestion"]
                    else "; no strategy fits this hardware: use more devices, a smaller model or "
                         "a smaller dataset.batch_size")
    rows.append(("verdict", verdict))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


def infeasible_message(plan: dict[str, Any]) -> str:
    """One paragraph: what the run needs, what the hardware has, and what would fit."""
    mem = plan["memory_per_device_bytes"]
    hint = (f" strategy={plan['suggestion']} would fit." if plan["suggestion"]
            else " No strategy fits: use more devices, a smaller model or a smaller dataset.batch_size.")
    if plan.get("max_micro_batch") and plan["max_micro_batch"] < plan["micro_batch"]:
        hint += f" With strategy={plan['strategy']}, dataset.batch_size<={plan['max_micro_batch']} fits."
    cap = plan["capacity_per_device_bytes"]
    if not plan.get("host_memory_ok", True):
        need = f"{mem['host_offload'] / 1e9:,.1f} GB of host memory per device (offload)"
        have = "more host memory than hardware.host_memory_gb allows"
    else:
        need = f"{mem['total'] / 1e9:,.1f} GB per device"
        have = f"{cap / 1e9:,.1f} GB ({plan['capacity_source']})" if cap is not None else "unknown"
    return (f"Plan infeasible: strategy={plan['strategy']} needs {need} but hardware={plan['hardware']} "
            f"has {have}.{hint}")
