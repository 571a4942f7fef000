"""Multirun sweeps (each trial a real 2-process job) and recipe templates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import FAST

SMALL_CORPUS = "dataset.max_bytes=2000000"  # a 2 MB slice of tinycode: smaller, not different
SWEEP = ["-m", "optim.lr=1e-3,2e-3", *FAST, "trainer.max_steps=3"]


def _manifest(root: Path) -> dict:
    (path,) = root.glob("gpt/sweeps/*/manifest.json")
    return json.loads(path.read_text())


@pytest.mark.launch
@pytest.mark.slow
def test_optuna_sweep_maximizing_validation_loss(loom, tmp_path):
    """README: `sweep.objective=validation.loss`, `sweep.direction=maximize`; three trials in one
    process, each of whose log lines is printed once (not once per trial so far)."""
    r = loom("train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "optim.lr=interval(1e-4,1e-2)",
             "sweep.objective=validation.loss", "sweep.direction=maximize",
             "strategy=single", *FAST, "trainer.max_steps=3", timeout=400)
    assert r.rc == 0, r.out + r.err
    m = _manifest(tmp_path)
    assert m["objective"] == "validation.loss" and m["direction"] == "maximize"
    assert len(m["trials"]) == 3 and all(t["state"] == "completed" for t in m["trials"])
    for t in m["trials"]:
        assert 1e-4 <= t["params"]["optim.lr"] <= 1e-2
        s = json.loads((Path(t["run_dir"]) / "summary.json").read_text())
        assert t["objective"] == pytest.approx(s["validation"]["loss"])
        assert t["objective"] != pytest.approx(s["final_loss"])
    best = max(m["trials"], key=lambda t: t["objective"])  # maximize: the highest is the best
    assert (f"best trial: optim.lr={best['params']['optim.lr']} (validation.loss {best['objective']:.4f}, "
            "the highest)") in r.out
    assert r.out.count("training loop started at step 0") == 3
    assert len(re.findall(r"^dataset tinycode: ", r.out, re.M)) == 3


def test_bad_sweep_inputs_are_refused(loom, tmp_path):
    r = loom("train", "-m", "hydra/sweeper=optuna", "sweep.objective=accuracy", "optim.lr=interval(1e-4,1e-2)")
    assert r.rc == 2 and "sweep.objective" in r.err and "final_loss" in r.err
    r = loom("train", "-m", "optim.lr=interval(1e-4,1e-2)")
    assert r.rc == 2 and "interval" in r.err and "optuna" in r.err
    r = loom("train", "-m", "optim.lr=1e-3,abc")
    assert r.rc == 2 and "optim.lr" in r.err
    assert not list(tmp_path.glob("gpt/sweeps/*/*/config.yaml")), "no trial may start"


def test_recipes_list_show_copy(loom, tmp_path):
    r = loom("recipes", "list")
    assert r.rc == 0
    names = [n for n in ("gpt-pretrain", "scaling-study", "lr-search", "zero3-big-model", "digits-classifier",
                         "finetune-hf") if n in r.out]
    assert len(names) == 6
    r = loom("recipes", "show", "gpt-pretrain")
    assert r.rc == 0 and "@package _global_" in r.out and "name: gpt_small" in r.out
    r = loom("train", "recipe=nope")
    assert r.rc == 2 and "gpt-pretrain" in r.err
    dest = tmp_path / "mine" / "my-pretrain.yaml"
    r = loom("recipes", "copy", "gpt-pretrain", str(dest))
    assert r.rc == 0 and dest.exists()
    dest.write_text(dest.read_text().replace("max_steps: 300", "max_steps: 7"))
    r = loom("recipes", "copy", "gpt-pretrain", str(dest))
    assert r.rc == 2 and "--force" in r.err and "max_steps: 7" in dest.read_text()
    r = loom("train", "recipe=my-pretrain", f"hydra.searchpath=[file://{dest.parent}]", "--cfg", "job")
    assert r.rc == 0 and "max_steps: 7" in r.out and "experiment: gpt-pretrain" in r.out


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, smoke",
    [
        ("gpt-pretrain", ["model=gpt_tiny", "trainer.max_steps=3", SMALL_CORPUS]),
        ("lr-search", ["trainer.max_steps=2", "sweep.n_trials=1", SMALL_CORPUS]),
        ("digits-classifier", ["trainer.max_steps=3"]),
        ("zero3-big-model", ["model=gpt_tiny", "trainer.max_steps=2", SMALL_CORPUS]),
        # one strategy at its 1 and 2 devices: the recipe's sweep and report, not every strategy again
        ("scaling-study", ["trainer.max_steps=2", "sweep.params.strategy=ddp", SMALL_CORPUS]),
    ],
)
def test_recipe_smoke_run(loom, tmp_path, recipe, smoke):
    """Every recipe at smoke size: only steps and model shrink."""
    r = loom("train", f"recipe={recipe}", *smoke, "tracking=csv", timeout=400)
    assert r.rc == 0, r.out + r.err
    summaries = [json.loads(p.read_text()) for p in tmp_path.rglob("summary.json")]
    assert summaries and all(s["status"] == "completed" for s in summaries)


@pytest.mark.launch
@pytest.mark.slow
def test_finetune_hf_recipe_smoke_run_on_local_stand_ins(loom, tmp_path):
    """The recipe names gpt2 + wikitext (hub artifacts); tests never reach the network, so the
    smoke run points it at a tiny local GPT-2 config, tokenizer and corpus instead."""
    from tests_helpers import make_hf_config, make_tokenizer, write_json_corpus

    tok = make_tokenizer(tmp_path / "tok")
    cfg = make_hf_config(tmp_path / "tiny-gpt2", vocab_size=300)
    data = write_json_corpus(tmp_path / "docs.jsonl", 300, column="text")
    r = loom("train", "recipe=finetune-hf", f"model.config={cfg}", f"dataset.tokenizer={tok}", "dataset.hub=null",
             "dataset.config=null", f"dataset.path={data}", "dataset.seq_len=32", "trainer.max_steps=3",
             "tracking=csv", timeout=400)
    assert r.rc == 0, r.out + r.err
    assert r.summary()["status"] == "completed"


def test_finetune_hf_recipe_without_the_hub_cache_says_what_is_missing(loom):
    r = loom("train", "recipe=finetune-hf", env={"HF_HOME": "/nonexistent-hf-home"})
    assert r.rc == 2 and ("gpt2" in r.err or "wikitext" in r.err) and "Traceback" not in r.err
