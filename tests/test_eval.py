"""Benchmark evaluation with lm-evaluation-harness (issue 52): the `eval` group's engine, checks and
shipped tasks, and `loom eval RUN_DIR --tasks ...`.

No launch of its own. In-process (no run): the engine over a small torch network (the shipped tasks,
the RESULT's shape, greedy generation stopping at the task's `until`), the refusals at validation
(`loom plan`: an unknown task lists the closest names, a Hub task without local data is refused
naming it, a generation budget over the context). On the suite's shared runs (`loom eval` in this
process): Loom's score of a shipped task equals lm-eval's own CLI on the exported model exactly;
fsdp (DCP), zero3 (ZeRO) checkpoints, a LoRA run (merged by peft) and a GPT run (Loom's own network)
are scored; `--step` without such a checkpoint lists the steps there are.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST, launching_fixture, strategy_args
from omegaconf import OmegaConf
from test_llama_runs import completed_llama_runs
from test_sft import sft_args

from loom import cli
from loom.eval.engine import byte_tokenizer, evaluate, flat_metrics, greedy
from loom.eval.registry import SHIPPED
from loom.rundir.paths import RunDir

SHIPPED_TASKS = ("tinycode_mc", "tinycode_complete", "tinycode_ppl")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _loom(*argv: str) -> tuple[int, str, str]:
    """`loom <argv>` through the CLI's own main, in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _ev(tasks, **kw) -> object:
    return OmegaConf.create({"tasks": list(tasks), "limit": 6, "num_fewshot": None, "batch_size": 4,
                             "apply_chat_template": False, "max_length": None, **kw})


class Bigram(torch.nn.Module):
    """A network whose next byte is a fixed function of the current one (ids -> logits)."""

    def __init__(self, table: dict[int, int] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return self.head(self.emb(x))
        logits = torch.full((*x.shape, 256), -10.0)
        for b, nxt in self.table.items():
            logits[x == b, nxt] = 10.0
        return logits


# ----------------------------------------------------------------------------- in-process: the engine


def test_byte_tokenizer_ids_are_the_utf8_bytes():
    tok = byte_tokenizer()
    text = "def f(x):\n    return 'é'\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text
    assert tok.eos_token_id == 0 and len(tok) == 256


def test_engine_scores_the_shipped_tasks(monkeypatch):
    """Every shipped task through lm-eval, offline: the RESULT has each task's metrics (acc and
    acc_norm, exact_match, perplexities) for `limit` documents, and flat_metrics names them."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    result = evaluate(Bigram(), byte_tokenizer(), _ev(SHIPPED_TASKS), max_length=64, device="cpu", step=7)
    assert result["step"] == 7 and set(result["tasks"]) == set(SHIPPED_TASKS)
    mc = result["tasks"]["tinycode_mc"]
    assert set(mc["metrics"]) == {"acc", "acc_norm"} and 0 <= mc["metrics"]["acc"] <= 1
    assert mc["samples"] == 6 and mc["n_shot"] == 0 and mc["stderr"]["acc"] >= 0
    assert set(result["tasks"]["tinycode_complete"]["metrics"]) == {"exact_match"}
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(result["tasks"]["tinycode_ppl"]["metrics"])
    flat = flat_metrics(result)
    assert flat["eval/tinycode_mc/acc"] == mc["metrics"]["acc"] and all(k.count("/") == 2 for k in flat)


def test_greedy_generation_stops_at_the_until_string():
    """Greedy decoding of a left-padded batch: each row's own context, new ids until the stop string,
    rows right-padded to one width after the padded context (what HFLM slices)."""
    tok = byte_tokenizer()
    net = Bigram({ord("a"): ord("b"), ord("b"): ord("c"), ord("c"): ord("\n"), ord("x"): ord("a")})
    context = torch.tensor([[0, 0, ord("a")], [ord("x"), ord("x"), ord("b")]])
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    out = greedy(net, tok, context, mask, max_length=20, stop=["\n"], window=64)
    assert out.shape[0] == 2 and torch.equal(out[:, :3], context)
    assert tok.decode(out[0, 3:].tolist()).startswith("bc\n")
    assert tok.decode(out[1, 3:].tolist()).rstrip("\x00").startswith("c\n")


# ----------------------------------------------------------------------------- in-process: refusals


def _plan(tmp_path: Path, *args: str) -> tuple[int, str]:
    with contextlib.chdir(tmp_path):
        rc, _, err = _loom("plan", *FAST, "trainer.max_steps=2", f"run.root={tmp_path}", *args)
    return rc, err


def test_an_unknown_task_lists_the_closest_names(tmp_path):
    rc, err = _plan(tmp_path, "eval.tasks=[tinycode_m]")
    assert rc == 2 and "unknown task 'tinycode_m'" in err and "Closest names: tinycode_mc" in err, err


def test_a_hub_task_without_local_data_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    rc, err = _plan(tmp_path, "eval.tasks=[arc_easy]")
    assert rc == 2 and "allenai/ai2_arc" in err and "HF_DATASETS_OFFLINE" in err and "\n" not in err.strip(), err


def test_a_local_task_yaml_by_path_and_a_generation_budget_over_the_context(tmp_path):
    """A task YAML given by path is found; tinycode_complete's 40 new tokens leave no room in 32."""
    rc, err = _plan(tmp_path, f"eval.tasks=[{SHIPPED / 'tinycode_mc.yaml'}]")
    assert rc == 0, err
    rc, err = _plan(tmp_path, "eval.tasks=[tinycode_complete]", "eval.max_length=32")
    assert rc == 2 and "max_gen_toks" in err and "32 tokens" in err, err
    rc, err = _plan(tmp_path, "eval.tasks=[tinycode_mc]", "eval.max_length=100000")
    assert rc == 2 and "eval.max_length" in err, err


# ----------------------------------------------------------------------------- the shared runs


@launching_fixture(scope="module")
def llama(shared) -> dict:
    """tests/test_llama_runs.py's single (final/ a Hugging Face dir), fsdp and zero3 (checkpoints of
    steps 5 and 10): the same arguments, the same runs."""
    return completed_llama_runs(shared, ("single", "fsdp", "zero3"))


def _scored(run_dir: Path, *args: str) -> dict:
    rc, out, err = _loom("eval", str(run_dir), *args)
    assert rc == 0, err[-3000:]
    assert "| tinycode_mc | acc |" in out, out
    return out


def test_loom_scores_equal_lm_evals_own_cli_on_the_export(llama, tmp_path, monkeypatch):
    """`loom eval` of the single run, then `lm_eval run --model hf` on the export it made, with the
    same settings (the byte tokenizer saved for it; max_length: the 64 tokens the run trained on,
    which Loom gives lm-eval, where the CLI would take the config's 256 positions): acc and acc_norm,
    and the perplexities summed from every log-likelihood, are the same numbers."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    run_dir = llama["single"].run_dir
    _scored(run_dir, "--tasks", "tinycode_mc,tinycode_ppl", "--limit", "60", "--batch-size", "8")
    ours = json.loads(RunDir(run_dir).eval_result(10).read_text())
    assert ours["source"] == "checkpoint" and ours["step"] == 10
    tok = tmp_path / "bytes"
    byte_tokenizer().save_pretrained(tok)
    export = RunDir(run_dir).export("hf", 10)
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
           f"pretrained={export},tokenizer={tok},dtype=float32,max_length=64", "--tasks", "tinycode_mc,tinycode_ppl",
           "--include_path",
           str(SHIPPED), "--device", "cpu", "--batch_size", "8", "--limit", "60", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]
    for task, metrics in (("tinycode_mc", ("acc", "acc_norm")), ("tinycode_ppl", ("word_perplexity", "byte_perplexity"))):
        mine = ours["tasks"][task]["metrics"]
        assert [mine[m] for m in metrics] == [theirs[task][f"{m},none"] for m in metrics], (task, mine, theirs[task])


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_loom_eval_reads_a_sharded_checkpoint(llama, strategy):
    """--step 5: fsdp's DCP directory, zero3's ZeRO partitions, scored; the file names its step."""
    run_dir = llama[strategy].run_dir
    _scored(run_dir, "--tasks", "tinycode_mc", "--step", "5", "--limit", "8")
    result = json.loads(RunDir(run_dir).eval_result(5).read_text())
    assert result["step"] == 5 and result["tasks"]["tinycode_mc"]["samples"] == 8


def test_a_missing_step_is_refused_listing_the_steps(llama):
    rc, _, err = _loom("eval", str(llama["fsdp"].run_dir), "--tasks", "tinycode_mc", "--step", "7")
    assert rc == 2 and "--step 7" in err and "available steps: 5, 10" in err, err


def test_loom_eval_of_a_lora_run_merges_its_adapter(shared):
    r = shared.get(*sft_args(shared, "lora"))
    assert r.rc == 0, r.err[-3000:]
    _scored(r.run_dir, "--tasks", "tinycode_mc", "--limit", "8")
    assert RunDir(r.run_dir).eval_result(4).is_file()


def test_loom_eval_of_a_gpt_run_uses_loom_s_network(shared):
    """gpt_tiny has no transformers architecture: its zero3 run's final weights go through
    `--format loom` into the run's own network."""
    r = shared.get(*strategy_args("zero3"))
    assert r.rc == 0, r.err[-3000:]
    _scored(r.run_dir, "--tasks", "tinycode_mc,tinycode_ppl", "--limit", "8")
    result = json.loads(RunDir(r.run_dir).eval_result(10).read_text())
    assert set(result["tasks"]) == {"tinycode_mc", "tinycode_ppl"}
