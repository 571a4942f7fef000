"""Tensor and pipeline parallelism for any transformers decoder, from its own config's plans.

A transformers `*ForCausalLM` declares how it shards (`config.base_model_tp_plan`: a TP style
per module pattern, e.g. `layers.*.self_attn.q_proj: colwise`) and how it cuts
(`config.base_model_pp_plan`: embedding, layer list, final norm, in order). Loom applies those
plans instead of knowing each architecture, so Llama, Qwen3, Mistral, Gemma-2, Phi-3 and OLMo-2
train under TP and PP without per-model code.

Conventions: TP shards only the per-layer rules (patterns with a `*`); the embedding, final norm
and `lm_head` stay whole on every TP rank (FSDP2 shards them over data-parallel ranks). A
pipeline chunk runs the model's own `forward` and cuts it at its layers, so the glue between
modules (rotary embeddings, causal and sliding-window masks, embedding scaling, logit
soft-capping) stays the model's.

Top-level imports are torch-free: the checks run in the torch-free validation.
"""

from __future__ import annotations

import functools
import math
import re
from types import SimpleNamespace
from typing import Any

# The transformers TP styles Loom applies (names from `ALL_PARALLEL_STYLES`), each checked for
# step-by-step parity with single-process training (tests/test_hf_parallel.py).
# `replicated_with_grad_allreduce` is Loom's own implementation (see `_install_grad_allreduce`).
TP_STYLES: frozenset[str] = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
    "rowwise_rep", "replicated_with_grad_allreduce", "replicate",
})


def _layer_rules(tp_plan: dict[str, str]) -> dict[str, str]:
    """The per-layer rules: top-level ones (an embedding's `embedding_rowwise`) are not applied."""
    return {k: v for k, v in tp_plan.items() if "*" in k}


def tp_problem(tp_plan: dict[str, str] | None, tp: int, heads: int, kv_heads: int) -> str | None:
    """Why a model cannot train at tensor-parallel size `tp` under its `base_model_tp_plan`, or None."""
    if tp <= 1:
        return None
    if not tp_plan or not _layer_rules(tp_plan):
        return f"the model declares no base_model_tp_plan (per-layer rules), so it cannot run at tp={tp}"
    for pattern, style in _layer_rules(tp_plan).items():
        if style not in TP_STYLES:
            return (f"the model's base_model_tp_plan gives {pattern!r} the TP style {style!r}, which Loom "
                    f"does not apply; supported styles: {', '.join(sorted(TP_STYLES))}")
    if heads % tp or kv_heads % tp:
        valid = [d for d in range(1, math.gcd(heads, kv_heads) + 1) if math.gcd(heads, kv_heads) % d == 0]
        return (f"tp={tp} must divide the attention heads ({heads}) and key/value heads ({kv_heads}); "
                f"valid tp values: {valid}")
    return None


def pp_problem(pp_plan: dict[str, Any] | None, tied: bool, n_layers: int, n_stages: int) -> str | None:
    """Why a model cannot be cut into `n_stages` pipeline stages under its `base_model_pp_plan`, or None."""
    if n_stages <= 1:
        return None
    if not pp_plan:
        return f"the model declares no base_model_pp_plan, so it cannot be cut into {n_stages} pipeline stages"
    if tied:
        return ("the model ties its input embedding to lm_head (tie_word_embeddings), but the first and last "
                "pipeline stages hold them apart; untie them with model.overrides.tie_word_embeddings=false")
    if n_layers < n_stages:
        return f"{n_layers} decoder layers cannot fill {n_stages} pipeline stages (at most {n_layers})"
    return None


def stage_layers(stage: int, n_stages: int, n_layers: int) -> range:
    """The layers of `stage`: an even split, later stages taking the remainder (as Loom's own models)."""
    return range(stage * n_layers // n_stages, (stage + 1) * n_layers // n_stages)


def pipeline_split(model: Any) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(layers, first, last) module paths of a `*ForCausalLM` from its pp plans: the fields of
    `loom.models.pipeline_split.PipelineSplit`, so checkpoint code can map a key to its stage."""
    prefix = model.base_model_prefix
    keys = list(model.config.base_model_pp_plan)
    base = getattr(model, prefix)
    at = next(i for i, k in enumerate(keys) if type(getattr(base, k)).__name__ == "ModuleList")
    last = tuple(f"{prefix}.{k}" for k in keys[at + 1:])
    head = [k for k in getattr(model, "_pp_plan", None) or {"lm_head": None} if k.split(".")[0] != prefix]
    last += tuple(head)
    return f"{prefix}.{keys[at]}", tuple(f"{prefix}.{k}" for k in keys[:at]), last


def _generic(name: str) -> str:
    """`layers.3.mlp` -> `layers.*.mlp`, as transformers matches plan patterns; wrappers' segments
    (activation checkpointing's, torch.compile's) dropped, as Loom wraps layers before TP."""
    name = re.sub(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)", "", name).lstrip(".")
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def expanded_tp_plan(model: Any) -> dict[str, str]:
    """The per-layer rules of `base_model_tp_plan` for the modules (and their own parameters) that exist in
    `model`, with numbers for `*`: layers pruned away by the pipeline (parameter-free stand-ins) match nothing."""
    prefix = model.base_model_prefix
    rules = _layer_rules(model.config.base_model_tp_plan or {})
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name.startswith(prefix + "."):
            continue
        generic = _generic(name[len(prefix) + 1:])
        style = rules.get(generic)
        for param, _ in module.named_parameters(recurse=False):
            if (p_style := rules.get(f"{generic}.{param}", style)) is not None:
                out[f"{name}.{param}"] = p_style
        if style is not None:
            out[name] = style
    return out


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> int:
    """Shard `model`'s decoder layers over the 1-D `tp_mesh` by its `base_model_tp_plan`, with transformers'
    own styles; returns the number of modules parallelized. Works on a meta-device model (parameters become
    DTensors whose local shards `to_empty` materializes) and on a real one (each rank keeps its shard)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = model.config
    if problem := tp_problem(config.base_model_tp_plan, tp_mesh.size(), config.num_attention_heads,
                             getattr(config, "num_key_value_heads", None) or config.num_attention_heads):
        raise ValueError(problem)
    plan = expanded_tp_plan(model)
    if not plan:
        raise ValueError(f"{type(model).__name__}'s base_model_tp_plan matches none of its modules")
    own = {k: v for k, v in plan.items() if v == "replicated_with_grad_allreduce"}
    apply_tensor_parallelism(model, tp_mesh, {k: v for k, v in plan.items() if k not in own})
    modules = dict(model.named_modules())
    group = tp_mesh.get_group()
    for name in own:
        if name in modules:
            _install_grad_allreduce(modules[name], group)
    return sum(1 for k in plan if k in modules)


def _install_grad_allreduce(module: Any, group: Any) -> None:
    """`replicated_with_grad_allreduce`, summed per backward. A norm over this rank's heads only (Qwen3's
    q_norm / k_norm) holds a whole parameter of which each rank sees part of the gradient. transformers sums
    `param.grad` in a post-accumulate-grad hook, i.e. after accumulation: with 2 micro-batches the second
    all-reduce sums the first micro-batch's already summed gradient again (measured: q_norm's gradient at tp 2
    came out 1.75x the single-process one). Here the parameter enters the forward through an identity whose
    backward all-reduces the gradient over the TP group, so each micro-batch's part is summed once, before it
    is accumulated, and FSDP2 (over dp) then reduces an already TP-summed gradient."""
    import torch

    forward = module.forward

    def tp_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        saved = dict(module._parameters)
        for name, p in saved.items():
            if p is not None and p.requires_grad:
                module._parameters[name] = _torch_parts().AllReduceGrad.apply(p, group)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = tp_forward


class _Stop(Exception):
    """Raised by a hook after a chunk's last layer: the rest of the model's forward is another stage's."""


def pipeline_chunks(model: Any, stages: list[int], n_stages: int) -> list[Any]:
    """Prune `model` in place to this rank's `stages` and return one module per stage for
    `torch.distributed.pipelining.PipelineStage`. Layers of other stages become parameter-free stand-ins
    (kept layers keep their names); the embedding goes where stage 0 is not held, the final norm and
    `lm_head` where the last stage is not. A chunk registers its own layers (and embedding / norm / head) so
    FSDP2 can shard it as a root; the model is not its submodule (no second names for its parameters)."""
    parts = _torch_parts()
    config = model.config.get_text_config()
    n_layers = config.num_hidden_layers
    if problem := pp_problem(config.base_model_pp_plan, bool(getattr(config, "tie_word_embeddings", False)),
                             n_layers, n_stages):
        raise ValueError(problem)
    layers_path, first, last = pipeline_split(model)
    layers = model.get_submodule(layers_path)
    held = {i for s in stages for i in stage_layers(s, n_stages, n_layers)}
    for i in range(n_layers):
        if i not in held:
            layers[i] = parts.Skip()
    for paths, stage in ((first, 0), (last, n_stages - 1)):
        if stage not in stages:
            for path in paths:
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent), attr, None)
    ends = {"first": first, "last": last}
    return [parts.PipelineChunk(model, layers, stage, n_stages, held, ends) for stage in stages]


@functools.cache
def _torch_parts() -> SimpleNamespace:
    """The torch classes, defined on first use so that importing this module stays torch-free."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    class AllReduceGrad(torch.autograd.Function):
        """Identity forward; backward sums the gradient over the TP group."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class Skip(nn.Module):
        """A parameter-free stand-in for a decoder layer another stage holds: passes hidden states through."""

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return args[0] if args else kwargs["hidden_states"]

    class PipelineChunk(nn.Module):
        """One pipeline stage of a transformers decoder: runs the model's own forward, cut at its layers.

        The first stage calls `model(input_ids=x)`; a later one `model(inputs_embeds=zeros)`, whose shape
        gives the positions and per-layer masks, with a pre-hook that feeds x to its first layer. A non-last
        stage stops after its last layer: a hook captures the output and raises (the graph up to it stays).
        The last returns the logits (soft-capping and all). Input: token ids or activations, no mask."""

        def __init__(self, model: Any, layers: Any, stage: int, n_stages: int, held: set[int],
                     ends: dict[str, tuple[str, ...]]) -> None:
            super().__init__()
            object.__setattr__(self, "model", model)  # not a submodule: its parameters keep one name
            object.__setattr__(self, "_layer_list", layers)
            self.own = stage_layers(stage, n_stages, model.config.get_text_config().num_hidden_layers)
            self.is_first, self.is_last = stage == 0, stage == n_stages - 1
            self.others = sorted(held - set(self.own))
            self.layers = nn.ModuleDict({str(i): layers[i] for i in self.own})
            keep = (ends["first"] if self.is_first else ()) + (ends["last"] if self.is_last else ())
            self.ends = nn.ModuleDict({p.replace(".", "__"): model.get_submodule(p) for p in keep})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            layers, model = self._layer_list, self.model
            swapped = {i: layers[i] for i in self.others}
            for i in self.others:  # another chunk's layers on this rank: stand-ins during this forward
                layers[i] = Skip()
            handles, out = [], {}
            try:
                if self.is_first:
                    call = {"input_ids": x}
                else:  # the model builds positions and masks from the shape; the first own layer gets x
                    hidden = model.config.get_text_config().hidden_size
                    call = {"inputs_embeds": x.new_zeros(*x.shape[:2], hidden)}

                    def feed(_m: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                        if args:
                            return (x, *args[1:]), kwargs
                        return args, {**kwargs, "hidden_states": x}

                    handles.append(layers[self.own[0]].register_forward_pre_hook(feed, with_kwargs=True))
                if not self.is_last:
                    def stop(_m: Any, _args: tuple, output: Any) -> None:
                        out["h"] = output[0] if isinstance(output, tuple) else output
                        raise _Stop

                    handles.append(layers[self.own[-1]].register_forward_hook(stop))
                try:
                    return model(**call, use_cache=False).logits
                except _Stop:
                    return out["h"]
            finally:
                for h in handles:
                    h.remove()
                for i, layer in swapped.items():
                    layers[i] = layer

    return SimpleNamespace(AllReduceGrad=AllReduceGrad, Skip=Skip, PipelineChunk=PipelineChunk)
