"""What a preference objective's reference model costs, for each way of having it, and which the plan
recommends (loom.objectives.reference says what the ways are).

Per device and per step, against the policy's own training step (6N FLOPs per token, 2N of them the
forward, `evaluation.FORWARD_SHARE`):
- adapters (LoRA): no memory; one more forward of both completions per step (2N per token).
- online: the weights once more in compute precision, partitioned as the strategy partitions the
  policy's (FSDP: over dp_shard; DDP, ZeRO-1/2: whole), and that forward per step.
- precompute: nothing per step; once, before the first step, one forward per pair of the data.
The plan recommends adapters under LoRA; otherwise precompute when the run trains at least as many
pairs as the data holds (its one pass costs no more than online's forward per step) or the copy does
not fit beside the states; online when it trains fewer pairs than the data holds and the copy fits.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom import strategies
from loom.layout import ParallelLayout
from loom.objectives import reference_of
from loom.plan.evaluation import FORWARD_SHARE


def reference_cost(cfg: DictConfig, layout: ParallelLayout, params: float, flops_per_token: float | None,
                   global_batch: int, pairs: int | None, room: float | None) -> dict[str, Any] | None:
    """plan.json `reference`: the run's mode, each mode's bytes per device, FLOPs per step and FLOPs
    once, and the recommendation with its reason (None: the objective has no reference). `global_batch`:
    the pairs of one step; `pairs`: the
    train and validation pairs (None: not rendered yet); `room`: device bytes left beside the run's
    estimate (None: capacity unknown)."""
    mode = reference_of(cfg)
    if mode is None:
        return None
    mixed = cfg.hardware.precision != "32-true"
    shards = layout.dp_shard if strategies.option(cfg.strategy.name).states == "all" else 1
    copy = (2.0 if mixed else 4.0) * params / max(1, shards)
    per_pair = FORWARD_SHARE * flops_per_token * 2 * int(cfg.dataset.seq_len) if flops_per_token else None
    forward = per_pair * global_batch if per_pair is not None else None
    once = per_pair * pairs if per_pair is not None and pairs is not None else None
    options = {"online": {"bytes_per_device": copy, "flops_per_step": forward, "flops_once": 0.0},
               "precompute": {"bytes_per_device": 0.0, "flops_per_step": 0.0, "flops_once": once}}
    if mode == "adapters":
        options = {"adapters": {"bytes_per_device": 0.0, "flops_per_step": forward, "flops_once": 0.0}, **options}
    best, why = _recommend(mode, copy, int(cfg.trainer.max_steps) * global_batch, pairs, room)
    return {"mode": mode, **options[mode], "options": options, "pairs": pairs, "recommended": best, "why": why}


def _recommend(mode: str, copy: float, trained: int, pairs: int | None, room: float | None) -> tuple[str, str]:
    if mode == "adapters":
        return "adapters", "LoRA: the base with its adapters off is the reference, at no memory"
    if room is not None and copy > room:
        return "precompute", "a frozen copy does not fit beside the policy's states"
    if pairs is not None and trained < pairs:
        return "online", (f"the run trains {trained:,} pairs of the data's {pairs:,}: a forward per trained pair "
                          "costs less than one over them all")
    return "precompute", "one forward per pair, once and reused by later runs; no copy in memory"


def cost_line(ref: dict[str, Any]) -> str:
    """`loom plan`'s reference row."""
    gb = ref["bytes_per_device"] / 2**30
    step = f", {ref['flops_per_step'] / 1e12:,.3g} TFLOP/step" if ref.get("flops_per_step") else ""
    once = f", {ref['flops_once'] / 1e12:,.3g} TFLOP once" if ref.get("flops_once") else ""
    rec = "" if ref["recommended"] == ref["mode"] else f"; recommended: {ref['recommended']}"
    return f"{ref['mode']}: {gb:,.2f} GB per device{step}{once}{rec} ({ref['why']})"
