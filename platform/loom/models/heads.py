"""What a transformers network ends in (`model.head`, hf_causal_lm's key; a model without it is `lm`):
the causal LM's vocabulary head, or `score`, one scalar per token (a Bradley-Terry reward model,
transformers' `...ForSequenceClassification` with num_labels=1). One owner of each head's facts:
the transformers classes that build and export it, what it sets on the config, the parameters a
causal LM's weights do not hold (drawn fresh, and trained beside LoRA adapters), peft's task type.
Torch-free: the launcher's checks, `loom export` and the worker read it alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PEFT_PREFIX = "base_model.model."  # a PeftModel's prefix before the wrapped model's names


@dataclass(frozen=True)
class Head:
    name: str
    auto_class: str          # transformers' Auto class that builds the network from its config
    mapping: str             # transformers.models.auto.modeling_auto's name table: model_type -> class name
    task_type: str           # peft's LoraConfig.task_type for a LoRA run's adapter
    config: dict[str, Any] = field(default_factory=dict)  # set on the architecture's config
    own: tuple[str, ...] = ()  # the head's modules: not in a causal LM's weights, drawn by the std rule
    outputs: int | None = None  # values per token it writes (the plan's logits memory); None: the vocabulary
    summary: str = ""

    def owns(self, name: str) -> bool:
        """Whether parameter `name` is the head's own: the network's name (`score.weight`), a
        LightningModule's or checkpoint's (`model.score.weight`) or peft's (`base_model.model.score.weight`)."""
        names = {name, name.removeprefix("model."), name.removeprefix(PEFT_PREFIX)}
        return any(n == m or n.startswith(f"{m}.") for n in names for m in self.own)

    def own_params(self, width: int) -> int:
        """Parameters of the head's own modules (trained beside LoRA's adapters): width x outputs, no bias."""
        return width * int(self.outputs or 0) if self.own else 0

    def class_name(self, model_type: str | None) -> str | None:
        """transformers' class of this head for an architecture (config.json's model_type), None: none."""
        from transformers.models.auto import modeling_auto

        return getattr(modeling_auto, self.mapping).get(str(model_type)) if model_type else None


HEADS: dict[str, Head] = {
    "lm": Head("lm", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM",
               summary="the causal LM (next-token logits over the vocabulary)"),
    "score": Head("score", "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                  "SEQ_CLS", config={"num_labels": 1}, own=("score",), outputs=1,
                  summary="a scalar score per token, read at the sequence's last token (a reward model)"),
}


def head_of(m: Any) -> Head:
    """The head `model.head` names (validated by the family's checks; absent: lm)."""
    return HEADS[str(m.get("head") or "lm")]
