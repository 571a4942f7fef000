"""Multirun sweeps (each trial a real 2-process job) and recipe templates."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import FAST

SMALL_CORPUS = "dataset.max_bytes=2000000"  # a 2 MB slice of tinycode: smaller, not different
SWEEP = ["-m", "optim.lr=1e-3,2e-3", *FAST, "trainer.max_steps=3"]


def _manifest(root: Path, experiment: str = "gpt") -> dict:
    """The sweep's manifest under <root>/<experiment>/ (the experiment is the model's family)."""
    (path,) = root.glob(f"{experiment}/sweeps/*/manifest.json")
    return json.loads(path.read_text())


@pytest.mark.launch
@pytest.mark.slow
def test_optuna_sweep_maximizing_validation_loss(loom, tmp_path):
    """README: `sweep.objective=validation.loss`, `sweep.direction=maximize`; a failed trial is
    recorded and the sweep goes on (trial 0's model raises at its first step); three trials in one
    process, each of whose log lines is printed once (not once per trial so far)."""
    from tests_helpers import helpers_env

    (tmp_path / "fail-next-trial").write_text("")  # the working dir of the sweep (and its one-process trials)
    r = loom("train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "optim.lr=interval(1e-4,1e-2)",
             "sweep.objective=validation.loss", "sweep.direction=maximize", "model=custom",
             "model.module._target_=tests_helpers.FailsOnce", "security.allow_targets=[tests_helpers.]",
             "strategy=single", *FAST, "trainer.max_steps=3", timeout=400, env=helpers_env(tmp_path))
    assert r.rc == 1, r.out + r.err  # not every trial completed
    m = _manifest(tmp_path, "custom")
    assert m["objective"] == "validation.loss" and m["direction"] == "maximize"
    assert [t["state"] for t in m["trials"]] == ["failed", "completed", "completed"], m["trials"]
    failed, m["trials"] = m["trials"][0], m["trials"][1:]
    assert failed["exit_code"] == 1 and failed["objective"] is None
    assert json.loads((Path(failed["run_dir"]) / "summary.json").read_text())["status"] == "failed"
    assert "injected failure of this trial" in (Path(failed["run_dir"]) / "logs" / "rank-0.log").read_text()
    assert "sweep dir: " in r.out and "(2/3 trials completed)" in r.out
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


# Each recipe's promise, checked on its resolved config and plan (no launch): what a smoke run
# adds is a run of the same strategies and models that other files train already (gpt-pretrain:
# the e2e ddp run; digits-classifier: test_data's digits runs; zero3-big-model: the zero3 parity
# run; finetune-hf: test_models' hf run, which trains this recipe on local stand-ins).


def _stand_in_trials(tmp_path: Path, fail_at: int | None = None):
    """`run_sweep`'s run_trial with each trial's training replaced: trial i leaves the run dir and
    summary.json a trial would (final loss 1 + i; trial `fail_at` failed, exit 1)."""
    seen: list[list[str]] = []

    def run_trial(overrides):
        i, failed = len(seen), len(seen) == fail_at
        seen.append(overrides)
        run_dir = tmp_path / f"trial-{i}"
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps({"status": "failed" if failed else "completed",
                                                          "final_loss": 1.0 + i}))
        return (1, run_dir, "boom") if failed else (0, run_dir, None)

    return run_trial


def test_gpt_pretrain_and_digits_classifier_recipes_resolve_to_what_they_name():
    from loom.pipeline import resolve

    cfg = resolve(["recipe=gpt-pretrain", "hardware=cpu"])
    assert (cfg.experiment, cfg.model.name, cfg.strategy.name, cfg.dataset.name) == (
        "gpt-pretrain", "gpt_small", "ddp", "tinycode")
    assert (cfg.trainer.max_steps, cfg.checkpoint.every_n_steps) == (300, 100)
    cfg = resolve(["recipe=digits-classifier", "hardware=cpu"])
    assert (cfg.experiment, cfg.model.name, cfg.dataset.name, cfg.strategy.name) == (
        "digits-classifier", "mlp", "digits", "ddp")
    assert (cfg.model.in_features, cfg.model.num_classes, cfg.optim.lr) == (64, 10, 3e-3)


def test_zero3_big_model_recipe_fits_where_ddp_does_not():
    """The recipe's point: gpt_125m on its memory budget fits under ZeRO-3, not under DDP or
    ZeRO-2, whose plans name a fix (its smoke run trained gpt_tiny: the shipped recipe did not fit)."""
    from loom.pipeline import resolve
    from loom.plan import make_plan

    def plan(*extra):
        return make_plan(resolve(["recipe=zero3-big-model", "hardware=cpu", *extra]))

    zero3, ddp, zero2 = plan(), plan("strategy=ddp"), plan("strategy=zero2")
    assert zero3.fits and zero3.params > 80e6, zero3.memory_per_device_bytes  # gpt_125m, not shrunk
    assert not ddp.fits and ddp.suggestion_overrides == ["strategy=fsdp"]
    assert not zero2.fits and zero2.suggestion_overrides == ["trainer.activation_checkpointing=full"]


@pytest.mark.parametrize(("recipe", "smoke", "expected"), [
    ("scaling-study", [], [{"strategy": s, "hardware.devices": d} for s in ("ddp", "fsdp", "zero2", "zero3")
                           for d in ("1", "2")]),
    ("lr-search", [], 8),
])
def test_sweep_recipes_enumerate_their_trials(tmp_path, recipe, smoke, expected):
    """A recipe's `sweep.params` make `loom train recipe=...` a sweep without -m: scaling-study is
    the 4 x 2 grid of strategies and device counts, lr-search 8 Optuna trials of a log-uniform lr
    in [1e-4, 1e-2] minimizing final_loss. The real sweep loop; each trial's training replaced by
    a stand-in that records its overrides and a final loss."""
    from loom.pipeline import resolve
    from loom.sweep import run_sweep, translate

    run_trial = _stand_in_trials(tmp_path)
    overrides = translate([f"recipe={recipe}", "hardware=cpu", f"run.root={tmp_path}", *smoke])
    base = resolve(overrides)
    _, manifest = run_sweep(overrides, base, resolve, run_trial)
    assert all(t.state == "completed" for t in manifest.trials)
    if isinstance(expected, list):
        assert [t.params for t in manifest.trials] == expected
        return
    assert (base.sweep.sampler, base.sweep.objective, base.sweep.direction) == ("optuna", "final_loss", "minimize")
    lrs = [t.params["optim.lr"] for t in manifest.trials]
    assert len(lrs) == expected and all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == expected


def test_finetune_hf_recipe_without_the_hub_cache_says_what_is_missing(loom):
    r = loom("train", "recipe=finetune-hf", env={"HF_HOME": "/nonexistent-hf-home"})
    assert r.rc == 2 and ("gpt2" in r.err or "wikitext" in r.err) and "Traceback" not in r.err


def test_a_failed_trial_is_told_to_optuna_as_failed(tmp_path, monkeypatch):
    """README: Optuna optimizes the sweep's objective; a failed trial is reported to the study as
    failed (not as a number, not left running). The real sweep loop and study; only the training
    of each trial is replaced (trial 1 fails, the others record a final loss), and the study is
    kept to read what it was told."""
    import optuna

    from loom.pipeline import resolve
    from loom.sweep import run_sweep, split_sweep, translate

    studies = []
    real = optuna.create_study
    monkeypatch.setattr(optuna, "create_study", lambda **kw: studies.append(real(**kw)) or studies[-1])

    run_trial = _stand_in_trials(tmp_path, fail_at=1)

    overrides = translate(["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "optim.lr=interval(1e-4,1e-2)",
                           "hardware=cpu", f"run.root={tmp_path}"])
    _, manifest = run_sweep(overrides, resolve(split_sweep(overrides)[0]), resolve, run_trial)
    assert [t.state for t in manifest.trials] == ["completed", "failed", "completed"]
    assert manifest.trials[1].error == "boom" and manifest.trials[1].exit_code == 1
    (study,) = studies
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
    assert [t.value for t in study.trials] == [1.0, None, 3.0]


# ------------------------------------------------------------------ what a sweep ranks by

@pytest.mark.parametrize(("overrides", "expected"), [
    (["strategy=ddp,fsdp,zero2"], ("throughput.tokens_per_sec", "maximize")),
    (["hardware.devices=1,2"], ("throughput.tokens_per_sec", "maximize")),
    (["dataset.batch_size=4,8", "strategy.tensor_parallel=1,2", "strategy=fsdp_tp"],
     ("throughput.tokens_per_sec", "maximize")),
    (["dataset=digits", "model=mlp", "strategy=ddp,fsdp"], ("throughput.samples_per_sec", "maximize")),
    (["strategy=ddp,fsdp", "sweep.objective=final_loss"], ("final_loss", "minimize")),  # said explicitly
    (["strategy=ddp,fsdp", "hydra.sweeper.direction=minimize"], ("final_loss", "minimize")),
    (["strategy=ddp,fsdp", "optim.lr=1e-3,1e-2"], ("final_loss", "minimize")),  # lr changes the losses
    (["recipe=scaling-study"], ("throughput.tokens_per_sec", "maximize")),  # sweep.params: strategy, devices
    (["recipe=lr-search"], ("final_loss", "minimize")),  # the recipe sets its objective
])
def test_a_sweep_over_layouts_ranks_by_throughput_unless_told(overrides, expected, capsys):
    """Strategies, hardware, batch size (and below them: strategy.tensor_parallel) change speed and
    memory, not the losses: such a sweep's objective defaults to throughput, maximized; an
    objective or direction the command or recipe sets, or any other swept key, keeps sweep.*."""
    from loom.pipeline import resolve
    from loom.sweep import split_sweep, sweep_objective, translate

    overrides = translate(["hardware=cpu", *overrides])
    fixed, sweeps = split_sweep(overrides)
    base = resolve(fixed)
    keys = [s.key_or_group for s in sweeps] + list(base.sweep.params or {})
    assert sweep_objective(base, keys, overrides) == expected
    said = capsys.readouterr().out
    assert (f"[sweep] objective: {expected[0]} (maximize): the swept keys (" in said) == (expected[1] == "maximize")


def test_a_strategy_sweep_records_and_ranks_throughput(tmp_path):
    """The real sweep loop (each trial's training replaced by a summary.json): the manifest's
    objective is throughput, and each trial's objective value is its summary's tokens/s."""
    from loom.pipeline import resolve
    from loom.sweep import run_sweep, split_sweep, translate

    rates = iter([900.0, 1200.0])

    def run_trial(overrides):
        run_dir = tmp_path / next(o for o in overrides if o.startswith("strategy="))
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "final_loss": 4.2,
                                                          "throughput": {"tokens_per_sec": next(rates)}}))
        return 0, run_dir, None

    overrides = translate(["strategy=ddp,fsdp", "hardware=cpu", f"run.root={tmp_path}"])
    _, manifest = run_sweep(overrides, resolve(split_sweep(overrides)[0]), resolve, run_trial)
    saved = json.loads(manifest.path.read_text())
    assert (saved["objective"], saved["direction"]) == ("throughput.tokens_per_sec", "maximize")
    assert [(t["params"], t["objective"]) for t in saved["trials"]] == [({"strategy": "ddp"}, 900.0),
                                                                        ({"strategy": "fsdp"}, 1200.0)]
