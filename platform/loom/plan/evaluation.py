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

from loom.eval import model_context
from loom.eval.registry import SHIPPED
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
    for f in sorted(SHIPPED.glob("*.yaml")):
        doc = _load(f)
        if doc.get("task") == entry:
            return f
    return None


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


def _documents(doc: dict[str, Any], here: Path | None) -> list[dict[str, Any]]:
    """The documents of a local task's evaluated split ([]: not local, or not JSON lines)."""
    data = _data_file(doc, here) if here is not None else None
    try:
        rows = [json.loads(ln) for ln in data.read_text().splitlines() if ln.strip()] if data is not None else []
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict)]


def _field(doc: dict[str, Any], key: str) -> str | None:
    """The document field a `{{field}}` template (or a bare field name) names."""
    v = doc.get(key)
    return v.strip("{} ") if isinstance(v, str) else None


def task_cost(entry: str, limit: int | None, max_length: int, bytes_per_token: float) -> dict[str, Any]:
    """{documents, requests, tokens (forward), assumed (DEFAULT_DOCUMENTS taken)} of one evaluation of a task.
    A local task's requests are measured on its documents: a multiple-choice request is the document
    without its other choices; a generation forwards its context once per generated token (no cache)."""
    f = _task_file(entry)
    doc = _load(f) if f is not None else {}
    rows = _documents(doc, f.parent if f is not None else None)
    docs = min(len(rows) or DEFAULT_DOCUMENTS, limit or len(rows) or DEFAULT_DOCUMENTS)
    kind = doc.get("output_type", "multiple_choice")
    choices = [r.get(_field(doc, "doc_to_choice") or "") for r in rows] if kind == "multiple_choice" else []
    per_doc = [len(c) if isinstance(c, list) and c else CHOICES for c in choices] or [CHOICES]
    per_doc_mean = sum(per_doc) / len(per_doc) if kind == "multiple_choice" else 1

    def request_tokens(r: dict[str, Any], c: Any) -> float:
        text = len(json.dumps(r, ensure_ascii=False))
        if isinstance(c, list) and c:  # the context and one choice: the others' characters left out
            text -= sum(len(str(x)) for x in c) * (len(c) - 1) / len(c)
        return text / bytes_per_token

    if rows:
        sizes = [request_tokens(r, c) for r, c in zip(rows, choices or [None] * len(rows), strict=True)]
        per_request = min(max_length, max(1, round(sum(sizes) / len(sizes))))
    else:
        per_request = min(max_length, DEFAULT_TOKENS)
    requests = round(docs * per_doc_mean)
    if kind == "generate_until":
        gen = int((doc.get("generation_kwargs") or {}).get("max_gen_toks", MAX_GEN_TOKS))
        tokens = docs * gen * min(max_length, per_request + gen // 2)
    else:
        tokens = requests * per_request
    return {"documents": docs, "requests": requests, "tokens": tokens, "assumed": not (rows or limit)}


def eval_cost(cfg: DictConfig, flops_per_token: float | None, peak: float | None) -> dict[str, Any] | None:
    """plan.json `evaluation` (None: eval.tasks is empty): evaluations, requests and forward tokens per
    evaluation, seconds per evaluation and in all at the plan's rate (None without a FLOP count)."""
    ev = cfg.get("eval")
    if ev is None or not ev.get("tasks"):
        return None
    max_length = int(ev.get("max_length") or model_context(cfg))
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
