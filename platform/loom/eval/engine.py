"""The engine: a network (token ids -> logits) scored by lm-evaluation-harness.

Loom does not reimplement task logic: `evaluate` wraps the network and a Hugging Face tokenizer in
an lm-eval LM (`LoomLM`, an `HFLM` subclass, as torchtune's eleuther_eval does) and runs lm-eval's
`simple_evaluate` over the tasks of `eval.tasks` (registered names, the shipped local tasks, the
user's task YAMLs). HFLM does the tokenizing, batching, padding and scoring exactly as it does for
a Hugging Face model; only the forward pass (`_model_call`) and greedy generation
(`_model_generate`) are Loom's. No hub access: HFLM gets objects, never names.

torch, transformers and lm_eval are imported inside the functions (the group's package is imported
by the CLI's first second).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# A byte-level run's text is its UTF-8 bytes (ids 0..255, dataset.tokenizer=null); NUL, absent from
# the text Loom trains on, stands for the start/end of a text where lm-eval asks for one.
BYTE_EOS = 0


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE vocabulary spells bytes with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer() -> Any:
    """A PreTrainedTokenizerFast whose ids are the raw UTF-8 bytes, as Loom's byte data encodes text
    (no special tokens are added; byte 0 is its EOS/pad, for lm-eval's prefix and padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = alphabet[BYTE_EOS]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, bos_token=eos,
                                   clean_up_tokenization_spaces=False)


class _Model:
    """What HFLM reads of a model object: its device and a config (no hub, no from_pretrained)."""

    def __init__(self, network: Callable, device: Any) -> None:
        import torch
        from transformers import PretrainedConfig

        self.network = network
        self.device = torch.device(device)
        self.config = PretrainedConfig()


def make_lm(network: Callable, tokenizer: Any, *, max_length: int, batch_size: int, device: Any) -> Any:
    """The lm-eval LM of `network` (ids (B, T) -> logits (B, T, V)) and `tokenizer`."""
    from lm_eval.models.huggingface import HFLM

    class LoomLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            import torch

            with torch.no_grad():
                return self._model.network(inps)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            return greedy(self._model.network, self.tokenizer, context, generation_kwargs.get("attention_mask"),
                          max_length=max_length, stop=stop, window=self.max_length)

    return LoomLM(pretrained=_Model(network, device), backend="causal", tokenizer=tokenizer,
                  batch_size=batch_size, max_length=max_length)


def greedy(network: Callable, tokenizer: Any, context: Any, mask: Any, *, max_length: int, stop: list[str],
           window: int) -> Any:
    """Greedy decoding of each row (its left padding dropped) until one of `stop` appears in the new
    text, EOS, or `max_length` tokens in all; rows come back as HFLM expects: the padded context,
    then the new ids, right-padded with the pad id."""
    import torch

    rows = []
    width = context.shape[1]
    for i in range(context.shape[0]):
        ids = context[i] if mask is None else context[i][mask[i].bool()]
        new: list[int] = []
        with torch.no_grad():
            while width + len(new) < max_length:
                x = torch.cat([ids, torch.tensor(new, dtype=ids.dtype, device=ids.device)])[-window:]
                nxt = int(network(x[None])[0, -1].argmax())
                new.append(nxt)
                if nxt == tokenizer.eos_token_id or any(s in tokenizer.decode(new) for s in stop):
                    break
        rows.append(torch.cat([context[i], torch.tensor(new, dtype=context.dtype, device=context.device)]))
    longest = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return torch.stack([torch.nn.functional.pad(r, (0, longest - len(r)), value=pad) for r in rows])


def evaluate(network: Callable, tokenizer: Any, ev: Any, *, max_length: int, device: Any,
             step: int | None = None) -> dict[str, Any]:
    """lm-eval's scores of `network` on `ev.tasks` (an EvalConfig-like node): a RESULT
    {"step", "tasks": {task: {"metrics", "stderr", "version", "n_shot", "samples"}}, "seconds"}."""
    from lm_eval import evaluator

    from loom.eval.registry import manager_for

    start = time.perf_counter()
    names, manager = manager_for(list(ev.tasks))
    lm = make_lm(network, tokenizer, max_length=max_length, batch_size=int(ev.batch_size), device=device)
    out = evaluator.simple_evaluate(
        model=lm, tasks=names, num_fewshot=ev.num_fewshot, limit=ev.limit, task_manager=manager,
        apply_chat_template=bool(ev.apply_chat_template), log_samples=False, bootstrap_iters=BOOTSTRAP_ITERS)
    return result_of(out, step=step, seconds=time.perf_counter() - start)


# Resamples for the stderr of metrics without a closed form (perplexities); lm-eval's CLI default is
# 100000, seconds per task on a CPU. Scores are unaffected.
BOOTSTRAP_ITERS = 1000


def _metric_name(key: str) -> str:
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric}_{filt}"


def result_of(out: dict[str, Any], *, step: int | None, seconds: float) -> dict[str, Any]:
    """The RESULT of lm-eval's output dict (scores per task; stderr where lm-eval gives one). A
    metric is a "<metric>,<filter>" key of lm-eval's results (alias and sample_len are not)."""
    tasks: dict[str, Any] = {}
    for task, scores in out["results"].items():
        metrics, stderr = {}, {}
        for key, value in scores.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = _metric_name(key)
            if "_stderr" in key.partition(",")[0]:
                stderr[name.replace("_stderr", "", 1)] = float(value)
            else:
                metrics[name] = float(value)
        samples = out.get("n-samples", {}).get(task, {})
        tasks[task] = {"metrics": metrics, "stderr": stderr, "version": out.get("versions", {}).get(task),
                       "n_shot": int(out.get("n-shot", {}).get(task, 0) or 0),
                       "samples": int(samples.get("effective", 0)) if isinstance(samples, dict) else 0}
    return {"step": step, "tasks": tasks, "seconds": round(seconds, 3)}


def flat_metrics(result: dict[str, Any]) -> dict[str, float]:
    """{"eval/<task>/<metric>": score} of a RESULT (what the trackers log)."""
    return {f"eval/{task}/{metric}": value for task, t in result.get("tasks", {}).items()
            for metric, value in t["metrics"].items()}
