"""The rehearsal beside the plan: per rank, the plan's figure, the rehearsed one and their
difference, flagged beyond TOLERANCE (torch-free: the launcher renders what the rank
processes wrote)."""

from __future__ import annotations

from typing import Any

GB = 1024**3
TOLERANCE = 0.10  # a difference beyond 10% of the rehearsed figure is flagged
ROWS = ("params", "grads", "optimizer", "activations", "peak")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activation peak", "peak": "total peak"}


def planned_bytes(plan: dict[str, Any], pp_rank: int | None) -> dict[str, float]:
    """The plan's bytes per device for this rank: its pipeline stage's when it has one. `peak`
    is the plan's total less its runtime (the runtime and host offload are not tensors the
    tracker sees): states + activations, or the larger of gradients and activations where
    the gradients are freed before forward (`MemoryEstimate.step_bytes`)."""
    mem = plan["memory_per_device_bytes"]
    if pp_rank is not None and plan.get("pipeline"):
        mem = plan["pipeline"]["stages"][pp_rank]["memory_bytes"]
    out = {k: float(mem[k]) for k in ("params", "grads", "optimizer", "activations")}
    out["peak"] = float(mem["total"]) - float(mem.get("runtime", 0.0))
    return out


def compare_rank(plan: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """One rank's entry of plan.json `rehearsal.ranks`: measured, planned, flagged rows."""
    if "error" in measured:
        return measured
    planned = planned_bytes(plan, measured.get("pp_rank"))
    got = measured["bytes"]
    diff = {k: (planned[k] - got[k]) / got[k] if got[k] else (0.0 if not planned[k] else None) for k in ROWS}
    flagged = [k for k, d in diff.items() if d is None or abs(d) > TOLERANCE]
    return {**measured, "planned_bytes": planned, "difference": diff, "flagged": flagged}


def failures(rehearsal: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in rehearsal.get("ranks", []) if "error" in r]


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}"


def _unit(r: dict[str, Any]) -> tuple[str, float]:
    """GB, or MB for a rank whose figures are all under 1 GB (small CPU layouts)."""
    big = max([*r["bytes"].values(), *r["planned_bytes"].values()])
    return ("GB", GB) if big >= GB else ("MB", 1024.0**2)


def _pct(d: float | None) -> str:
    return "n/a" if d is None else f"{d:+.0%}"


def render_rehearsal(rehearsal: dict[str, Any]) -> None:
    """One table per rank (GB per device), or the ZeRO estimators' table, or the failure."""
    from rich.console import Console

    console = Console()
    if rehearsal.get("estimator"):
        console.print(_zero_table(rehearsal))
        return
    for r in rehearsal["ranks"]:
        if "error" in r:
            console.print(f"[red]rehearsal of rank {r['rank']} failed[/red] ({r['error_type']}): {r['error']}")
            continue
        console.print(_rank_table(r))
        console.print(f"  {r['device_note']}; {r['tracker']}; mesh {r['mesh']}; {r['seconds']:.1f} s")


def _rank_table(r: dict[str, Any]):
    from rich.table import Table

    where = ""
    if r.get("pp_rank") is not None:
        where = f", pipeline rank {r['pp_rank']}: stages {r['stages']}, layers {_span(r['blocks'])}"
    unit, scale = _unit(r)
    t = Table(title=f"rehearsal: rank {r['rank']}{where} (micro batch {r['micro_batch']}, {unit} per device)")
    for col in ("", "plan", "rehearsed", "plan vs rehearsed"):
        t.add_column(col, justify="left" if not col else "right")
    for k in ROWS:
        flag = k in r["flagged"]
        d = _pct(r["difference"][k])
        t.add_row(LABELS[k], f"{r['planned_bytes'][k] / scale:,.2f}", f"{r['bytes'][k] / scale:,.2f}",
                  f"[red]{d} ![/red]" if flag else d)
    return t


def _span(blocks: list[int]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if blocks else "none"


def _zero_table(z: dict[str, Any]):
    from rich.table import Table

    t = Table(title=f"rehearsal: {z['estimator']} (DeepSpeed cannot initialize over a fake process group)")
    for col in ("GB per device", "plan", "DeepSpeed", "plan vs DeepSpeed"):
        t.add_column(col, justify="left" if col == "GB per device" else "right")
    t.add_row("model states (params + grads + optimizer)", _gb(z["planned_states"]), _gb(z["deepspeed_states"]),
              _pct(z["difference"]))
    t.add_row("host (CPU) memory per node", "", _gb(z["deepspeed_host"]), "")
    if z.get("note"):
        t.caption = z["note"]
    return t
