"""The torch half of `loom eval`: the run's Hugging Face export (made or reused, as `loom generate`
does), loaded by transformers, its logits scored by loom.eval.engine (lm-eval's HFLM around them),
the RESULT written to `<run>/eval/step-NNNNNNN.json` and printed as a table.

The export is what lm-eval's own CLI would load (`lm_eval --model hf --model_args
pretrained=<export>`), so Loom's scores are that CLI's scores (tests/test_eval.py holds them equal)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from loom.atomic import atomic_write_text
from loom.errors import EXIT_OK
from loom.eval.engine import byte_tokenizer, evaluate
from loom.evaluate.request import EvalRequest
from loom.generate.text import exported_once, load_model, run_tokenizer
from loom.rundir.paths import RunDir


def tokenizer_of(req: EvalRequest) -> Any:
    """The run's tokenizer (local files only), or UTF-8 bytes for a byte-level run."""
    if req.tokenizer == "bytes":
        return byte_tokenizer()
    return run_tokenizer(req.tokenizer, "eval", req.export.run_dir)


def load_network(req: EvalRequest, path: Path) -> tuple[Callable, Any]:
    """(ids -> logits, device) of the export: transformers' model of a Hugging Face directory, or
    the run's own network (its LightningModule's build_model) over Loom's model.safetensors."""
    import torch

    if req.export.fmt == "hf":
        model = load_model(path)
        return (lambda ids: model(ids).logits), model.device
    from safetensors.torch import load_file

    from loom.models import build_module

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = build_module(req.export.cfg).build_model()
    net.load_state_dict(load_file(path / "model.safetensors"))
    net = net.to(device).eval()
    return net, device


def table(result: dict[str, Any]) -> str:
    """The scores, one row per task and metric (± stderr where lm-eval gives one)."""
    rows = ["| task | metric | value | stderr | n-shot | samples |", "|---|---|---|---|---|---|"]
    for task, t in result["tasks"].items():
        for metric, value in t["metrics"].items():
            err = t["stderr"].get(metric)
            rows.append(f"| {task} | {metric} | {value:.4f} | {'' if err is None else f'{err:.4f}'} | "
                        f"{t['n_shot']} | {t['samples']} |")
    return "\n".join(rows)


def run(req: EvalRequest, log: TextIO = sys.stderr) -> int:
    """`loom eval`: the export, the model, lm-eval's scores, the result file and the table."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = tokenizer_of(req)
    network, device = load_network(req, exported_once(req.export, "eval", log))
    step = req.export.source.step
    result = evaluate(network, tokenizer, req.ev, max_length=req.max_length, device=device, step=step)
    result["source"] = "checkpoint"
    path = RunDir(req.export.run_dir).eval_result(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    print(table(result), flush=True)
    print(f"loom eval: {req.export.source.describe(req.export.run_dir)}: {len(result['tasks'])} tasks in "
          f"{result['seconds']:.1f} s; scores in {path}", file=log)
    return EXIT_OK
