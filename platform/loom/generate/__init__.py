"""`loom generate RUN_DIR --prompt TEXT | --chat [--step N] [--max-new-tokens 64] [--temperature 0]
[--top-p 1.0] [--seed 0]`: text from a run's final weights or any checkpoint (any strategy's, in
one process), the first thing a person does after a fine-tune.

It picks the weights as `loom export` does (the same `--step`), makes or reuses their Hugging
Face export (`<run>/export/hf-step-<N>`: a LoRA run's merged by peft) and lets transformers do
the rest: `AutoModelForCausalLM.from_pretrained` and `generate`, with the run's tokenizer (or
UTF-8 bytes for a byte-level run) and, under `--chat`, its chat template (`dataset.chat_template`
over the tokenizer's). `request.py` checks the request torch-free (exit 2, one paragraph);
`text.py` imports torch and transformers only then.
"""

from __future__ import annotations

from loom.generate.request import GenerateRequest, Settings, request

__all__ = ["GenerateRequest", "Settings", "generate", "request"]


def generate(run: str, prompt: str | None, chat: bool, step: int | None = None, settings: Settings | None = None
             ) -> int:
    """The `loom generate` verb: check the request, then generate (ConfigError: exit 2)."""
    req = request(run, prompt, chat, step, settings or Settings())
    from loom.generate.text import run as run_generation

    return run_generation(req)
