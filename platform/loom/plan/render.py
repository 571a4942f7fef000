"""`loom plan`'s table (rich), from the plan as plan.json holds it."""

from __future__ import annotations

from typing import Any

from loom.plan.assumptions import phrase
from loom.plan.evaluation import cost_line
from loom.plan.memory import GB, HOST_USABLE
from loom.plan.reference import cost_line as reference_line


def render(plan: dict[str, Any]) -> None:
    """The plan as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    mem = plan["memory_per_device_bytes"]
    bpp = plan["bytes_per_param"]
    auto = plan.get("auto_choice")
    chosen = " (chosen by strategy=auto)" if auto else ""
    t = Table(title=f"loom plan: {plan['strategy']}{chosen} on {plan['hardware']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    hw = f"{plan['device_name']}, {plan['accelerator']}, {plan['backend']}, {plan['interconnect']}"
    if plan.get("resolved_from"):
        hw += f" (resolved from {plan['resolved_from']})"
    rows = [("strategy", f"{plan['strategy']}, chosen by strategy=auto: {auto['reason']}")] \
        if auto and auto.get("reason") else []
    rows += [
        ("hardware", hw),
        ("world size", f"{plan['world_size']} ({plan['num_nodes']} node(s) x {plan['devices_per_node']}), "
                       f"dp={plan['data_parallel']} tp={plan['tensor_parallel']}"
                       + (f" pp={plan['parallel']['pp']}" if plan.get("parallel", {}).get("pp", 1) > 1 else "")
                       + (f" cp={plan['parallel']['cp']}" if (plan.get("parallel", {}).get("cp") or 1) > 1 else "")),
        *_batch_rows(plan),
        ("model", (f"{plan['params'] / 1e6:,.1f}M params, " if plan["params"] is not None else "params unknown, ")
                  + (f"{plan['flops_per_token'] / 1e9:,.3f} GFLOP/token, {plan['flops_per_step'] / 1e12:,.2f} "
                     "TFLOP/step" if plan["flops_per_token"] is not None else "FLOPs unknown")),
        *_trainable_rows(plan),
        ("precision", f"{plan['precision']} ({bpp['params']:g}/{bpp['grads']:g}/{bpp['optimizer']:g} "
                      "bytes per param: params/grads/optimizer)"),
        ("params / grads / optim", f"{mem['params'] / GB:,.2f} / {mem['grads'] / GB:,.2f} / "
                                   f"{mem['optimizer'] / GB:,.2f} GB per device"),
        ("activations", f"{mem['activations'] / GB:,.2f} GB per device (micro batch {plan['micro_batch']}, "
                        f"activation checkpointing {plan.get('activation_checkpointing', 'none')})"),
    ]
    rows += _pipeline_rows(plan)
    if plan.get("deepspeed_config"):
        rows.append(("deepspeed", _deepspeed_precision(plan["deepspeed_config"])))
    if mem["host_offload"]:
        rows.append(("offloaded to host", f"{mem['host_offload'] / GB:,.2f} GB per device"))
    cap = plan["capacity_per_device_bytes"]
    runtime = mem.get("runtime", 0.0)
    rows.append(("total", f"{mem['total'] / GB:,.2f} GB of "
                          + (f"{cap / GB:,.2f} GB" if cap is not None else "? GB")
                          + f" ({plan['capacity_source']})"
                          + (f", incl. {runtime / GB:,.2f} GB runtime per process" if runtime else "")
                          + _step_peak_note(mem)))
    if plan["accelerator"] != "gpu" and plan.get("host_capacity_bytes"):
        rows.append(("host memory", _cpu_host_line(plan)))
    if plan["max_micro_batch"] is not None:
        rows.append(("max micro batch", f"{plan['max_micro_batch']} (activations permitting)"))
    if plan.get("build_host_source"):
        rows.append(("build host", f"{plan['build_host_bytes_per_rank'] / GB:,.2f} GB per rank "
                                   f"({plan['build_host_source']})"
                     + ("" if plan.get("build_host_ok", True) else " [red]does not fit the host[/red]")))
    rows += _comm_rows(plan)
    rows += _peak_rows(plan)
    if plan.get("evaluation"):
        rows.append(("evaluation", cost_line(plan["evaluation"])))
    if plan.get("reference"):
        rows.append(("reference", reference_line(plan["reference"])))
    verdict = "[green]fits[/green]" if plan["fits"] else "[red]does not fit[/red]"
    if not plan["fits"]:
        fix = _fix(plan)
        verdict += f"; {fix} would fit" if fix else f"; no strategy fits this hardware: {_no_fit_hint(plan)}"
    rows.append(("verdict", verdict))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)



def _peak_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """MFU's peak (float8: the float8 one, hardware.precision's beside it) and the float8 row."""
    peak, f8 = plan["peak_flops_per_device"], plan.get("float8")
    if not f8:
        return [("peak", f"{peak / 1e12:,.4g} TFLOP/s per device ({plan['precision']})" if peak
                 else "unknown (MFU will be null)")]
    basis = f8["peak_precision"] or plan["precision"]
    line = (f"{peak / 1e12:,.5g} TFLOP/s per device ({basis}: MFU's basis)" if peak
            else f"unknown (no hardware.peak_tflops.{basis}: MFU will be null)")
    bf16 = plan.get("peak_flops_per_device_bf16")
    if bf16 and bf16 != peak:
        line += f"; {plan['precision']} peak {bf16 / 1e12:,.5g} TFLOP/s beside it (perf/mfu_bf16_peak)"
    from loom.plan.float8 import float8_line

    return [("peak", line), ("float8", float8_line(f8))]


def _batch_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """seq_len, micro and global batch, each with where it came from (plan.json `assumptions`);
    one "batch" row for a plan.json from before they were recorded."""
    product = f"micro {plan['micro_batch']} x accum {plan['accumulate_grad_batches']} x dp {plan['data_parallel']}"
    tokens = f"{plan['tokens_per_step']:,} tokens/step"
    given = plan.get("assumptions") or {}
    if not given:
        return [("batch", f"{product} = global {plan['global_batch']} ({tokens})")]
    seq, micro, accum, glob = (given.get(k) or {} for k in
                               ("seq_len", "micro_batch", "accumulate_grad_batches", "global_batch"))
    line = f"{plan['global_batch']} = {product}, {tokens} ({phrase(glob)}"
    if accum.get("source") not in (None, "default"):  # accumulation set, or derived from the global batch
        line += f"; accum: {phrase(accum)}"
    return [("seq_len", f"{seq['value']} ({phrase(seq)})" if seq.get("value") is not None else phrase(seq)),
            ("micro batch", f"{plan['micro_batch']} per device ({phrase(micro)})"),
            ("global batch", line + ")")]


def _comm_rows(plan: dict) -> list[tuple[str, str]]:
    """Bytes per step by collective, and by mesh dimension with its number of calls."""
    comm = plan["comm_bytes_per_step_per_device"]
    detail = ", ".join(f"{k} {v / GB:,.3f}" for k, v in plan["comm_bytes_by_collective"].items() if v)
    line = f"{comm / GB:,.3f} GB per device per step" + (f" ({detail})" if detail else "")
    if plan["comm_time_s_at_measured_busbw"]:
        line += f", ~{plan['comm_time_s_at_measured_busbw']:.3f} s at the probed bus bandwidth"
    rows = [("communication", line)]
    dims = plan.get("comm_bytes_by_dimension") or {}
    calls = plan.get("comm_messages_per_step") or {}
    if sum(1 for v in dims.values() if v) > 1 or any(calls.values()):
        rows.append(("  by dimension", ", ".join(
            f"{k.replace('_', '-')} {dims.get(k, 0) / GB:,.3f} GB in {calls.get(k, 0):g} calls"
            for k in ("data_parallel", "tensor_parallel", "pipeline", "expert_parallel", "context_parallel")
            if dims.get(k) or calls.get(k))))
    if plan.get("context_parallel"):
        from loom.plan.context import context_line

        rows.append(("context parallel", context_line(plan["context_parallel"])))
    if plan.get("experts"):
        from loom.plan.experts import experts_line

        rows.append(("experts", experts_line(plan["experts"])))
    return rows

def _pipeline_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """The bubble, then one row per pipeline rank: its stages, blocks and memory per device."""
    pipe = plan.get("pipeline")
    if not pipe:
        return []
    v = pipe["stages_per_rank"]
    rows = [("pipeline", f"{pipe['schedule']}, {pipe['microbatches']} microbatches, "
                         f"{len(pipe['stages'])} ranks x {v} stage(s): bubble {pipe['bubble_fraction']:.1%} "
                         f"of each step ((pp-1)/({v}*m+pp-1))")]
    for st in pipe["stages"]:
        mem, blocks = st["memory_bytes"], st["blocks"]
        held = (f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
                if blocks == list(range(blocks[0], blocks[-1] + 1)) else f"blocks {blocks}")
        held += " + embeddings" * st["embeddings"] + " + head" * st["head"]
        rows.append((f"  pp rank {st['pp_rank']}",
                     f"stage(s) {st['stages']}: {held}, {st['params'] / 1e6:,.2f}M params; "
                     f"{mem['states'] / GB:,.3f} GB states + {mem['activations'] / GB:,.3f} GB activations "
                     f"({st['microbatches_in_flight']} microbatch(es) in flight) = {mem['total'] / GB:,.3f} GB"))
    return rows


def _cpu_host_need(plan: dict[str, Any]) -> float:
    """One CPU rank's host memory: runtime, states, activations (offload is the same memory)."""
    mem = plan["memory_per_device_bytes"]
    return mem["total"] + mem["host_offload"]


def _cpu_host_line(plan: dict[str, Any]) -> str:
    """CPU: ranks per node x one rank's memory against the node's usable host memory."""
    need, ranks, host = _cpu_host_need(plan), plan["devices_per_node"], plan["host_capacity_bytes"]
    line = (f"{ranks} processes x {need / GB:,.2f} GB = {ranks * need / GB:,.2f} GB of {host / GB:,.1f} GB "
            f"({HOST_USABLE:.0%} of hardware.host_memory_gb) per node")
    return line if ranks * need <= host else line + " [red]does not fit[/red]"


def _no_fit_hint(plan: dict[str, Any]) -> str:
    """What to change when no strategy fits: on CPU every process costs host memory, so fewer
    of them (more devices would make it worse); on GPUs more devices shard the states."""
    if plan["accelerator"] != "gpu" and plan.get("host_capacity_bytes"):
        from loom.hardware.machine import cpu_process_limit

        # no more than `loom train` accepts here (it refuses more CPU processes than the cores take)
        most = min(int(plan["host_capacity_bytes"] // _cpu_host_need(plan)), cpu_process_limit())
        fewer = f"hardware.devices<={most}, " if 1 <= most < plan["devices_per_node"] else ""
        return (f"use fewer processes per node ({fewer}each holds its own runtime), more host memory "
                "(hardware.host_memory_gb), a smaller model or a smaller dataset.batch_size")
    return "use more devices, a smaller model or a smaller dataset.batch_size"


def _deepspeed_precision(ds: dict[str, Any]) -> str:
    """The resolved DeepSpeed precision keys (Loom's defaults or the user's JSON); a key left
    null is DeepSpeed's own default: the model's dtype, overlap_comm only at stage 3."""
    zero = ds.get("zero_optimization") or {}
    model = "bf16" if (ds.get("bf16") or {}).get("enabled") else "fp16" if (ds.get("fp16") or {}).get("enabled") \
        else "fp32"
    overlap = zero.get("overlap_comm")
    overlap = zero.get("stage") == 3 if overlap is None else overlap
    return (f"ZeRO-{zero.get('stage')}, {model} model, overlap_comm {str(bool(overlap)).lower()}, "
            f"communication {ds.get('communication_data_type') or model}, "
            f"grad accumulation {(ds.get('data_types') or {}).get('grad_accum_dtype') or model}")


def _fix(plan: dict[str, Any]) -> str | None:
    """The overrides that would make the run fit (plan.json files from before
    `suggestion_overrides` name only a strategy)."""
    if plan.get("suggestion_overrides"):
        return " ".join(plan["suggestion_overrides"])
    return f"strategy={plan['suggestion']}" if plan.get("suggestion") else None


def infeasible_message(plan: dict[str, Any]) -> str:
    """One paragraph: what the run needs, what the hardware has, and what would fit."""
    fix = _fix(plan)
    hint = f" {fix} would fit." if fix else f" No strategy fits: {_no_fit_hint(plan)}."
    if plan.get("max_micro_batch") and plan["max_micro_batch"] < plan["micro_batch"]:
        hint += f" With strategy={plan['strategy']}, dataset.batch_size<={plan['max_micro_batch']} fits."
    short = [_device_shortfall(plan)]
    cpu_host_short = short[0] is not None and plan["accelerator"] != "gpu"  # its hint covers the build's
    if not plan.get("build_host_ok", True):
        per_rank, ranks = plan["build_host_bytes_per_rank"], plan["devices_per_node"]
        host = plan.get("host_capacity_bytes")
        short.append(f"building the model needs {per_rank / GB:,.1f} GB of host memory per rank "
                     f"({plan['build_host_source']}) x {ranks} ranks per node = {per_rank * ranks / GB:,.1f} GB, "
                     f"but the host has " + (f"{host / GB:,.1f} GB" if host is not None else "less")
                     + f" ({HOST_USABLE:.0%} of hardware.host_memory_gb)")
        host_hint = " Give each node more host memory (hardware.host_memory_gb) or fewer ranks (hardware.devices)."
        hint = host_hint if short[0] is None and not fix else hint if cpu_host_short else hint + host_hint
    why = "; ".join(x for x in short if x) or "more memory than the hardware has"
    return f"Plan infeasible: strategy={plan['strategy']} on hardware={plan['hardware']}: {why}.{hint}"


def _step_peak_note(mem: dict[str, Any]) -> str:
    """Why the total holds gradients and activations as it does (`MemoryEstimate.step_bytes`)."""
    if mem.get("grads_in_forward", True):
        return ""
    return ("; params + optimizer + the larger of grads and activations: the gradients are freed after each "
            "optimizer step and grow in backward as the activations are freed")


def _device_shortfall(plan: dict[str, Any]) -> str | None:
    """What the training states and activations need beyond the device (None: they fit)."""
    mem, cap = plan["memory_per_device_bytes"], plan["capacity_per_device_bytes"]
    if not plan.get("host_memory_ok", True):
        return (f"needs {mem['host_offload'] / GB:,.1f} GB of host memory per device (offload), "
                "more than hardware.host_memory_gb allows")
    need = mem["total"] + (mem["host_offload"] if plan["accelerator"] != "gpu" else 0.0)
    if cap is None or need <= cap:
        return None
    if plan["accelerator"] != "gpu" and plan.get("host_capacity_bytes"):
        ranks = plan["devices_per_node"]
        return (f"each process needs {need / GB:,.2f} GB of host memory ({mem.get('runtime', 0.0) / GB:g} GB "
                f"runtime + states + activations) x {ranks} processes per node = {need * ranks / GB:,.1f} GB, "
                f"but the host has {plan['host_capacity_bytes'] / GB:,.1f} GB ({HOST_USABLE:.0%} of "
                "hardware.host_memory_gb)")
    return f"needs {mem['total'] / GB:,.1f} GB per device but has {cap / GB:,.1f} GB ({plan['capacity_source']})"


def _trainable_rows(plan: dict) -> list[tuple[str, str]]:
    """LoRA: the adapters the optimizer trains (grads and optimizer bytes count them alone)."""
    n, total = plan.get("trainable_params"), plan.get("params")
    if n is None:
        return []
    share = f" ({100 * n / total:.2f}% of {total / 1e6:,.1f}M; the base is frozen)" if total else ""
    return [("trainable", f"{n / 1e6:,.2f}M params, LoRA adapters{share}")]
