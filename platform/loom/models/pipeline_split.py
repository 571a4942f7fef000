"""How a network is cut into pipeline stages: the per-model hook `strategies.pipeline` reads.

A network that can be pipelined (Loom's GPT and Llama; the registry's `pipeline=True`)
declares, as the class attribute `pipeline_split`, where its layer list is and which modules
only the first stage holds (embeddings) and only the last (final norm, head). Every other
module (GPT's dropout, Llama's rotary embedding) stays on every stage. It also gives the
three steps a stage runs, and composes its own `forward` from them, so a pipelined run
computes exactly what the single-device model does:

    embed(idx) -> h                 first stage only
    layer_inputs(h) -> tuple        every stage: what each layer takes beside h
                                    (Llama: the rotary cos and sin; GPT: nothing)
    layer(h, *layer_inputs) -> h    each of the stage's layers
    head(h) -> logits               last stage only

Torch-free (a dataclass of names), so the launcher and tests can reason about a split
without building anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    layers: str                  # attribute path of the layer list: "blocks", "model.layers"
    first: tuple[str, ...]       # module paths only the first stage holds (embeddings)
    last: tuple[str, ...]        # module paths only the last stage holds (final norm, head)

    def layer_of(self, key: str) -> int | None:
        """The layer index of a state-dict key or module path under `layers`, else None."""
        prefix = self.layers + "."
        return int(key[len(prefix):].split(".")[0]) if key.startswith(prefix) else None

    def stage_of(self, key: str, stage_of_layer: Callable[[int], int], n_stages: int) -> int:
        """The stage that holds the state-dict entry `key`. A module kept on every stage
        (none of Loom's has parameters) is attributed to stage 0, whose copy rank 0 holds."""
        layer = self.layer_of(key)
        if layer is not None:
            return stage_of_layer(layer)
        if _under(key, self.last):
            return n_stages - 1
        return 0


def _under(key: str, paths: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in paths)
