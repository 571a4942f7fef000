"""Context parallelism in the plan (torch-free): what `strategy.cp` changes, and plan.json's
`context_parallel`.

The cp ranks of one data-parallel rank read the same micro batch and each keeps seq_len / cp
tokens of every sequence (`loom.layout`). So, per device:
- activations are those of seq_len / cp tokens, the logits too (`local_seq_len`: Ulysses' full
  sequence q/k/v inside attention are head-sharded, the same size);
- FSDP2 shards parameters, gradients and optimizer states over dp_shard x cp (torchtitan's
  dp_shard_cp), and its all-gathers / reduce-scatters run over those ranks (`state_shards`);
- the sequence meets itself around attention (`context_bytes`, `context_calls`):
  - ulysses: per layer and micro batch, forward 4 all-to-alls over the cp group (q with n_head
    heads, k and v with n_kv_heads each, from sequence- to head-sharded; the output with n_head
    heads back), backward the 4 reverse ones. Each moves micro_batch x seq_len/cp x heads/tp x
    head_dim elements of the compute dtype, (cp - 1) / cp of them leaving the rank;
  - ring (CUDA): per layer, forward passes k and v of the local chunk (micro_batch x seq_len/cp x
    n_kv_heads/tp x head_dim each) cp - 1 steps around the ring, backward twice that (dk, dv
    travel too): counted as one call per tensor per step.
  Activation checkpointing recomputes a checkpointed layer's forward in backward, its
  exchanges too (selective: every other layer; full: all).
These calls block the layer that waits for them (`plan.compare` counts them exposed; torch's ring
overlaps its sends with each chunk's attention, so ring's is an upper bound).

`loom plan --compare` offers cp layouts (`cp_degrees`) for long sequences (seq_len >=
CP_MIN_SEQ_LEN) or when no layout without cp fits: on short sequences cp only adds exchanges.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from loom.data import rows_per_sample
from loom.layout import ParallelLayout
from loom.models import attention_heads, context_problem, kv_heads, layer_count, model_width

GB = 1e9
# `loom plan --compare` offers context-parallel layouts from this sequence length on (Llama 3's
# pre-training length; torchtitan and Megatron turn cp on for 32k-128k), or when nothing fits without.
CP_MIN_SEQ_LEN = 8192


def local_seq_len(cfg: DictConfig, cp: int) -> int:
    """The tokens of each sequence one rank holds: seq_len / cp."""
    return int(cfg.dataset.seq_len) // max(1, int(cp))


def state_shards(layout: ParallelLayout) -> int:
    """The ranks FSDP2 shards the training states over (and gathers / reduces them across): dp_shard x cp."""
    return layout.dp_shard * layout.cp


def head_dim(cfg: DictConfig) -> int:
    heads = attention_heads(cfg) or 1
    return model_width(cfg) // heads


def recomputed_share(cfg: DictConfig) -> float:
    """The share of layers whose forward activation checkpointing runs again in backward."""
    mode = cfg.trainer.get("activation_checkpointing", "none")
    layers = layer_count(cfg) or 1
    return {"none": 0.0, "selective": ((layers + 1) // 2) / layers, "full": 1.0}[mode]


def _elements(cfg: DictConfig, layout: ParallelLayout, heads: int) -> float:
    """Elements of one exchanged tensor: micro_batch x seq_len/cp x heads/tp x head_dim."""
    rows = int(cfg.dataset.batch_size) * rows_per_sample(cfg.dataset)
    return rows * local_seq_len(cfg, layout.cp) * heads / layout.tp * head_dim(cfg)


def layer_bytes(cfg: DictConfig, layout: ParallelLayout) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer and micro batch (0, 0 without cp)."""
    cp = layout.cp
    if cp <= 1:
        return 0.0, 0.0
    act = 4.0 if cfg.hardware.precision == "32-true" else 2.0
    heads, kv = attention_heads(cfg) or 1, kv_heads(cfg) or attention_heads(cfg) or 1
    if layout.cp_style == "ring":
        fwd = (cp - 1) * 2 * _elements(cfg, layout, kv) * act  # k and v, cp - 1 steps
        return fwd, 2 * fwd                                     # backward: k, v and dk, dv
    fwd = (2 * heads + 2 * kv) * _elements(cfg, layout, 1) * act * (cp - 1) / cp  # q, k, v in; out back
    return fwd, fwd


def layer_calls(layout: ParallelLayout) -> tuple[int, int]:
    """(forward, backward) exchanges per layer and micro batch."""
    if layout.cp <= 1:
        return 0, 0
    if layout.cp_style == "ring":
        return 2 * (layout.cp - 1), 4 * (layout.cp - 1)
    return 4, 4


def _per_step(cfg: DictConfig, layout: ParallelLayout, fwd: float, bwd: float) -> float:
    """Per layer and micro batch (forward, backward) -> per optimizer step, with recomputed forwards."""
    passes = int(cfg.trainer.accumulate_grad_batches) * (layer_count(cfg) or 1) / layout.pp
    return passes * (fwd * (1.0 + recomputed_share(cfg)) + bwd)


def context_bytes(cfg: DictConfig, layout: ParallelLayout) -> float:
    """Bytes one device sends per optimizer step in context parallelism's exchanges."""
    return _per_step(cfg, layout, *layer_bytes(cfg, layout))


def context_calls(cfg: DictConfig, layout: ParallelLayout) -> float:
    """Exchanges one device makes per optimizer step (all-to-alls, or ring sends)."""
    return _per_step(cfg, layout, *layer_calls(layout))


def collective(layout: ParallelLayout) -> str:
    """Its key in plan.json's `comm_bytes_by_collective`."""
    return "cp_ring_send" if layout.cp_style == "ring" else "cp_all_to_all"


def context_summary(cfg: DictConfig, layout: ParallelLayout) -> dict[str, Any] | None:
    """plan.json's `context_parallel` (None: cp = 1)."""
    if layout.cp <= 1:
        return None
    fwd, bwd = layer_bytes(cfg, layout)
    cf, cb = layer_calls(layout)
    return {
        "cp": layout.cp, "style": layout.cp_style, "seq_len": int(cfg.dataset.seq_len),
        "tokens_per_rank": local_seq_len(cfg, layout.cp), "activation_divisor": layout.cp,
        "state_shards": state_shards(layout), "heads": attention_heads(cfg), "kv_heads": kv_heads(cfg),
        "head_dim": head_dim(cfg), "collective": collective(layout),
        "bytes_per_layer": {"forward": fwd, "backward": bwd},
        "calls_per_layer": {"forward": cf, "backward": cb},
        "recomputed_share": recomputed_share(cfg),
        "bytes_per_step_per_device": context_bytes(cfg, layout),
        "calls_per_step": context_calls(cfg, layout),
    }


def context_line(s: dict[str, Any]) -> str:
    """The plan table's `context parallel` row."""
    what = ("all-to-alls (q, k, v in; out back)" if s["style"] != "ring" else "ring sends (k, v; dk, dv back)")
    per = s["calls_per_layer"]
    return (f"cp={s['cp']} ({s['style']}): {s['tokens_per_rank']:,} of {s['seq_len']:,} tokens per rank, "
            f"activations / {s['activation_divisor']}, states sharded over {s['state_shards']} ranks; "
            f"{per['forward']} + {per['backward']} {what} per layer, "
            f"{(s['bytes_per_layer']['forward'] + s['bytes_per_layer']['backward']) / GB:,.3f} GB per layer "
            f"per micro batch; {s['bytes_per_step_per_device'] / GB:,.3f} GB in {s['calls_per_step']:g} calls "
            "per device per step")


def cp_degrees(cfg: DictConfig, world: int) -> list[int]:
    """The cp degrees > 1 `loom plan --compare` may offer at `world` ranks: dividing the world and
    seq_len, for a model whose attention splits. Which style, if any, a layout takes (the heads
    divide by cp x tp, or ring on CUDA) is `strategies.variants.context_fields`'."""
    seq = cfg.dataset.get("seq_len")
    if not seq or context_problem(cfg) is not None:
        return []
    return [c for c in range(2, world + 1) if world % c == 0 and int(seq) % c == 0]


def worth_offering(cfg: DictConfig, fitting_without: bool) -> bool:
    """Whether `loom plan --compare` adds cp layouts: long sequences, or nothing fits without."""
    seq = cfg.dataset.get("seq_len") or 0
    return int(seq) >= CP_MIN_SEQ_LEN or not fitting_without
