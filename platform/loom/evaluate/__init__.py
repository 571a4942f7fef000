"""`loom eval RUN_DIR --tasks a,b [--step N] [--limit N] [--num-fewshot K] [--batch-size B]`: a run's
final weights or any checkpoint scored on benchmark tasks by lm-evaluation-harness, after the fact.

The weights are picked as `loom export` picks them (the same `--step`) and reach the engine the way
`loom generate` reaches transformers: the run's Hugging Face export (made, or reused when
`<run>/export/hf-step-<N>` holds it; any strategy's checkpoint, a LoRA run's adapter merged by
peft), loaded by AutoModelForCausalLM, whose logits `loom.eval.engine` scores. The scores go to
`<run>/eval/step-NNNNNNN.json` (source "checkpoint") and the console. `request.py` checks the
request torch-free (exit 2, one paragraph); `score.py` imports torch and lm_eval only then.
"""

from __future__ import annotations

from loom.evaluate.request import EvalRequest, request

__all__ = ["EvalRequest", "evaluate_run", "request"]


def evaluate_run(run: str, tasks: list[str], *, step: int | None = None, limit: int | None = None,
                 num_fewshot: int | None = None, batch_size: int | None = None) -> int:
    """The `loom eval` verb: check the request, then score (ConfigError: exit 2)."""
    req = request(run, tasks, step=step, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size)
    from loom.evaluate.score import run as run_scoring

    return run_scoring(req)
