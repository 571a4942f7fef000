"""What evaluation will cost (eval.tasks): evaluations x requests x tokens, at the plan's forward rate.

No lm-eval import (the plan answers in a blink): a local task's YAML (a path in eval.tasks, or one of the
shipped tasks) is read for its data file, output type and choices, and its documents counted; a registry
task, whose dataset is not counted here, is assumed DEFAULT_DOCUMENTS (eval.limit caps both). Rank 0
evaluates the gathered model alone, so the rate is one device's: the plan's compute rate (a `loom probe`
measurement, else the peak x rates.PEAK_EFFICIENCY, else an assumed figure) for forward-only FLOPs,
FORWARD_SHARE of a training step's per token. An estimate: the plan says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from loom.models import vocab_size
from loom.plan.rates import compute_rate

DEFAULT_DOCUMENTS = 1000   # documents of a task the plan does not count, without eval.limit
CHOICES = 4                # requests per document of a multiple-choice task whose choices are not counted
DEFAULT_TOKENS = 256       # tokens per request (context + continuation) when the documents are not read
MAX_GEN_TOKS = 256         # lm-eval's default generation length (generation_kwargs.max_gen_toks)
FORWARD_SHARE = 1 / 3      # a forward pass: 2N of a training step's 6N FLOPs per token


class _Tolerant(yaml.SafeLoader):
    """lm-eval's task YAMLs carry `!function module.name` tags: read as plain strings here."""


_Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)


def evaluations(max_steps: int, every: int, at_end: bool) -> int:
    """How many evaluations a run makes: every `every` steps, plus the end unless one falls on it."""
    n = max_steps // every if every > 0 else 0
    return n + int(at_end and not (every > 0 and max_steps % every == 0))


def _task_file(entry: str) -> Path | None:
    """The YAML of a task given by path, or of a shipped task by name (None: a registry task)."""
    path = Path(entry).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    for f in _shipped_tasks():
        doc = _load(f)
        if doc.get("task") == entry:
            return f
    return None


def _shipped_tasks() -> list[Path]:
    """The task YAMLs Loom ships (the eval group's `tasks/` folder), found without importing lm-eval."""
    from importlib.util import find_spec

    spec = find_spec("loom.eval")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(f for d in where for f in (Path(d) / "tasks").rglob("*.yaml"))


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.load(path.read_text(), Loader=_Tolerant)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _data_file(doc: dict[str, Any], here: Path) -> Path | None:
    """The JSONL of the split lm-eval evaluates (test, else validation) of a `dataset_path: json` task."""
    files = (doc.get("dataset_kwargs") or {}).get("data_files")
    split = doc.get("test_split") or doc.get("validation_split") or "test"
    name = files.get(split) if isinstance(files, dict) else files if isinstance(files, str) else None
    if not name:
        return None
    for base in (here, Path.cwd()):
        if (base / name).is_file():
            return base / name
    return None


def task_cost(entry: str, limit: int | None, max_length: int, bytes_per_token: float) -> dict[str, Any]:
    """{documents, requests, tokens (forward), assumed (DEFAULT_DOCUMENTS taken)} of one evaluation of a task."""
    f = _task_file(entry)
    doc = _load(f) if f is not None else {}
    data = _data_file(doc, f.parent) if f is not None else None
    lines = [ln for ln in data.read_text().splitlines() if ln.strip()] if data is not None else []
    docs = len(lines) if lines else DEFAULT_DOCUMENTS
    docs = min(docs, limit) if limit else docs
    per_request = min(max_length, max(1, round(sum(map(len, lines)) / len(lines) / bytes_per_token))) \
        if lines else min(max_length, DEFAULT_TOKENS)
    kind = doc.get("output_type", "multiple_choice")
    if kind == "multiple_choice":
        choices = doc.get("doc_to_choice")
        if isinstance(choices, str) and lines:
            first = json.loads(lines[0])
            choices = first.get(choices.strip("{} ")) if isinstance(first, dict) else None
        per_doc = len(choices) if isinstance(choices, list) and choices else CHOICES
        return {"documents": docs, "requests": docs * per_doc, "tokens": docs * per_doc * per_request,
                "assumed": not (lines or limit)}
    if kind == "generate_until":  # one forward per generated token over the growing sequence (no cache)
        gen = int((doc.get("generation_kwargs") or {}).get("max_gen_toks", MAX_GEN_TOKS))
        tokens = docs * gen * min(max_length, per_request + gen // 2)
        return {"documents": docs, "requests": docs, "tokens": tokens, "assumed": not (lines or limit)}
    return {"documents": docs, "requests": docs, "tokens": docs * per_request, "assumed": not (lines or limit)}


def eval_cost(cfg: DictConfig, flops_per_token: float | None, peak: float | None) -> dict[str, Any] | None:
    """plan.json `evaluation` (None: eval.tasks is empty): evaluations, requests and forward tokens per
    evaluation, seconds per evaluation and in all at the plan's rate (None without a FLOP count)."""
    ev = cfg.get("eval")
    if ev is None or not ev.get("tasks"):
        return None
    max_length = int(ev.get("max_length") or cfg.dataset.get("seq_len") or 2048)
    try:  # a byte vocabulary reads a character a token; a subword one about four
        byte_vocab = vocab_size(cfg) <= 512
    except (AttributeError, KeyError, TypeError, ValueError):
        byte_vocab = False
    tasks = {str(t): task_cost(str(t), ev.get("limit"), max_length, 1.0 if byte_vocab else 4.0) for t in ev.tasks}
    n = evaluations(int(cfg.trainer.max_steps), int(ev.get("every_n_steps") or 0), bool(ev.get("at_end", True)))
    tokens = sum(t["tokens"] for t in tasks.values())
    rate, source = compute_rate(cfg.hardware, peak)
    per_eval = tokens * flops_per_token * FORWARD_SHARE / rate if flops_per_token else None
    return {"evaluations": n, "requests_per_evaluation": sum(t["requests"] for t in tasks.values()),
            "tokens_per_evaluation": tokens, "seconds_per_evaluation": per_eval,
            "seconds": per_eval * n if per_eval is not None else None, "rate_flops": rate, "rate_source": source,
            "tasks": tasks}


def cost_line(ev: dict[str, Any]) -> str:
    """The plan table's `evaluation` row."""
    uncounted = [t for t, c in ev["tasks"].items() if c["assumed"]]
    guess = f"; {', '.join(uncounted)}: {DEFAULT_DOCUMENTS} documents assumed (not counted)" if uncounted else ""
    secs = ev["seconds_per_evaluation"]
    time = (f" ≈ {secs:,.3g} s each, {ev['seconds']:,.3g} s in all at {ev['rate_source']}, forward only"
            if secs is not None else " (time unknown: no FLOP count)")
    return (f"{ev['evaluations']} evaluation(s) x {ev['requests_per_evaluation']:,} requests, "
            f"{ev['tokens_per_evaluation']:,} tokens{time}; rank 0 alone{guess}")
