"""Expert parallelism in the plan (torch-free): what `strategy.ep` changes in a mixture of
experts' communication, and the plan's `experts` summary.

Memory per device is FSDP2's either way (the experts are split over ep ranks, then sharded over
the dp / ep ranks that hold the same ones: dp shards in all). What changes is the wire:
- the experts' all-gathers and reduce-scatters run over dp / ep ranks instead of dp (none at
  all when ep = dp): for Qwen3-30B-A3B, 95% of the parameters;
- every token's k copies travel to their experts' ranks and back, in forward and again in
  backward: 4 all-to-alls per MoE layer per micro batch of tokens x k x width activations,
  (ep - 1) / ep of them leaving the rank when routing is balanced. They block: the next
  computation needs the tokens (torchtitan and Megatron overlap them only with a second
  micro batch's compute, which Loom does not schedule), so the plan counts them exposed.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models import expert_count, expert_param_count, experts_per_token, layer_count, model_width

GB = 1e9


def expert_share(cfg: DictConfig, layout: ParallelLayout) -> float:
    """The routed experts' parameters a pipeline / tensor-parallel rank's data-parallel group
    reduces (0 without expert parallelism: then they are ordinary parameters)."""
    return expert_param_count(cfg) / (layout.tp * layout.pp) if layout.ep > 1 else 0.0


def expert_group_fraction(layout: ParallelLayout) -> float:
    """(n - 1) / n of the ring the experts' gathers and reductions run over (n = dp_shard / ep)."""
    n = layout.dp_shard // layout.ep
    return (n - 1) / n if n > 1 else 0.0


def all_to_all_bytes(cfg: DictConfig, layout: ParallelLayout) -> float:
    """Bytes one device sends per optimizer step in expert parallelism's all-to-alls."""
    if layout.ep == 1:
        return 0.0
    act = 4.0 if cfg.hardware.precision == "32-true" else 2.0
    tokens = cfg.dataset.batch_size * cfg.dataset.seq_len
    per_layer = 4 * tokens * experts_per_token(cfg) * model_width(cfg) * act * (layout.ep - 1) / layout.ep
    return cfg.trainer.accumulate_grad_batches * layer_count(cfg) / layout.pp * per_layer


def experts_summary(cfg: DictConfig, layout: ParallelLayout, active_params: int | None,
                    bandwidth_gbps: float | None) -> dict[str, Any] | None:
    """plan.json's `experts` (None: not a mixture of experts)."""
    experts = expert_count(cfg)
    if not experts:
        return None
    wire = all_to_all_bytes(cfg, layout)
    return {
        "experts": experts, "experts_per_token": experts_per_token(cfg), "ep": layout.ep,
        "experts_per_rank": experts // layout.ep, "expert_params": expert_param_count(cfg),
        "expert_shard_ranks": layout.dp_shard // layout.ep, "active_params": active_params,
        "all_to_all_bytes": wire,
        "all_to_all_exposed_s": wire / (bandwidth_gbps * GB) if wire and bandwidth_gbps else None,
    }


def experts_line(summary: dict[str, Any]) -> str:
    """The plan table's `experts` row: how ep splits them and what it costs on the wire."""
    s = summary
    line = (f"{s['experts']} routed x top-{s['experts_per_token']}, {s['expert_params'] / 1e9:,.2f}B params; "
            f"{(s['active_params'] or 0) / 1e9:,.2f}B active per token (MFU counts these)")
    if s["ep"] == 1:
        return line + "; strategy.ep=1: experts sharded like every other parameter"
    gathers = ("no all-gather or reduce-scatter of expert weights" if s["expert_shard_ranks"] == 1
               else f"expert weights gathered over {s['expert_shard_ranks']} ranks, not all")
    line += (f"; ep={s['ep']}: {s['experts_per_rank']} experts per rank, {gathers}; all-to-all "
             f"{s['all_to_all_bytes'] / GB:,.3f} GB per device per step")
    if s["all_to_all_exposed_s"]:
        line += f", ~{s['all_to_all_exposed_s']:.3f} s exposed"
    return line
