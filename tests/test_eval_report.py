"""Evaluation results read back, in-process (nothing launches): report.md's table and plots/eval.png from a
hand-written run dir (summary.json `eval` + eval/step-*.json), a sweep ranked by `eval/<task>/<metric>` and
its refusal at config time, and the plan's evaluation cost on a composed config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import open_dict

from loom.errors import ConfigError


def _result(step: int | None, acc: float, ppl: float | None = None, source: str = "loop") -> dict:
    """A RESULT as the engine writes it: one multiple-choice task (and a perplexity task when given)."""
    tasks = {"tiny_mc": {"metrics": {"acc": acc, "acc_norm": acc / 2}, "stderr": {"acc": 0.05},
                         "version": 1.0, "n_shot": 0, "samples": 20}}
    if ppl is not None:
        tasks["tiny_ppl"] = {"metrics": {"word_perplexity": ppl}, "stderr": {}, "version": 2, "n_shot": 0,
                             "samples": 5}
    return {"step": step, "tasks": tasks, "seconds": 1.5, "source": source}


def _run_dir(root: Path, name: str, evals: list[dict], status: str = "completed", rate: float = 1000.0) -> Path:
    """A run dir as the worker leaves it: summary.json (rundir.summary's own template) and metrics.csv."""
    from loom.pipeline import resolve
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = resolve(["hardware=cpu", "hardware.devices=1"])
    run = root / name
    run.mkdir(parents=True)
    s = empty_summary(cfg, name, layout_of(cfg))
    s.update(status=status, global_step=30, final_loss=2.0, first_loss=4.0, eval=evals)
    s["time"] = {**(s.get("time") or {}), "eval_s": 4.5}
    s["throughput"].update(tokens_per_sec=rate, samples_per_sec=rate / 64, steady=True)
    (run / "summary.json").write_text(json.dumps(s))
    rows = ["step,train/loss"] + [f"{i},{4.0 - i / 15!r}" for i in range(1, 31)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run


def test_report_has_the_eval_table_the_failed_evaluation_and_the_plot(tmp_path, capsys):
    """Scores per step, task and metric with stderr, n-shot, version and source; the failed evaluation a row
    saying so; a `loom eval` file for step 30 in place of the loop's; eval.png drawn beside loss.png."""
    from loom.report import report
    from loom.rundir.paths import RunDir
    from loom.tracking.plots import eval_series

    run = _run_dir(tmp_path, "r", [_result(10, 0.25, 80.0), {"step": 20, "error": "RuntimeError: out of memory"},
                                   _result(30, 0.5, 40.0)])
    RunDir(run).evals.mkdir()
    RunDir(run).eval_result(30).write_text(json.dumps(_result(30, 0.75, 20.0, source="checkpoint")))
    assert report([str(run)]) == 0
    md = (run / "report.md").read_text()
    assert "## Evaluation" in md
    assert "| 10 | tiny_mc | acc | 0.2500 | 0.0500 | 0 | 1.0 | 20 | loop |" in md
    assert "| 10 | tiny_ppl | word_perplexity | 80.0000 |  | 0 | 2 | 5 | loop |" in md
    assert "| 20 | (all) | evaluation failed | RuntimeError: out of memory |" in md
    assert "| 30 | tiny_mc | acc | 0.7500 | 0.0500 | 0 | 1.0 | 20 | checkpoint |" in md  # the file's, not 0.5
    assert "0.5000" not in md.split("## Evaluation")[1].split("## Plots")[0]
    assert "tiny_mc acc 0.7500" in capsys.readouterr().out  # the console's summary: the newest scores
    assert "| evaluation time | 4.5 s |" in md
    png = RunDir(run).plots / "eval.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![eval](plots/eval.png)" in md
    assert md.index("![loss]") < md.index("![eval]") < md.index("![throughput]")
    series = eval_series(json.loads(RunDir(run).summary.read_text())["eval"])
    assert series[("tiny_mc", "acc")] == [(10.0, 0.25, 0.05), (30.0, 0.5, 0.05)]  # the failed step has no point


def test_a_run_without_evaluations_has_no_section_and_no_eval_plot(tmp_path):
    from loom.report import report

    run = _run_dir(tmp_path, "r", [])
    assert report([str(run)]) == 0
    assert "## Evaluation" not in (run / "report.md").read_text()
    assert not (run / "plots" / "eval.png").exists()


def _sweep(root: Path, objective: str, direction: str, trials: dict[str, list[dict]]) -> Path:
    from loom.sweep import Manifest, Trial

    m = Manifest(root / "manifest.json", "t", ["-m"], objective, direction)
    for i, (lr, evals) in enumerate(trials.items()):
        run = _run_dir(root, f"trial{i}", evals)
        m.trials.append(Trial(i, [f"optim.lr={lr}"], "completed", run.name, str(run), 0, None, None,
                              {"optim.lr": lr}))
    m.save()
    return root


def test_a_sweep_ranks_its_trials_by_an_eval_metric_and_names_the_unscored_one(tmp_path, capsys, monkeypatch):
    """Maximize acc: the trial whose newest evaluation scored highest is best (not the one whose first
    was); `--objective eval/tiny_ppl/word_perplexity` re-ranks them, lowest first, with no --direction;
    a trial without the metric is "not evaluated" and unranked."""
    from loom.report import report

    monkeypatch.setenv("COLUMNS", "250")
    sweep = _sweep(tmp_path, "eval/tiny_mc/acc", "maximize", {
        "0.001": [_result(10, 0.9, 30.0), _result(30, 0.4, 30.0)],
        "0.003": [_result(10, 0.2, 50.0), _result(30, 0.6, 50.0)],
        "0.01": [{"step": 30, "error": "ValueError: bad"}],
    })
    assert report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "best trial: optim.lr=0.003 (eval/tiny_mc/acc 0.6000, the highest)" in out
    md = (sweep / "report.md").read_text()
    assert "not evaluated" in md
    assert report([str(sweep)], objective="eval/tiny_ppl/word_perplexity") == 0
    assert "best trial: optim.lr=0.001 (eval/tiny_ppl/word_perplexity 30.0000, the lowest)" in capsys.readouterr().out


def test_objective_of_reads_the_newest_score_and_the_summary_metrics():
    from loom.rundir.eval_results import objective_of

    s = {"final_loss": 2.5, "validation": {"loss": 2.0}, "eval": [_result(10, 0.3), _result(20, 0.4),
                                                                  {"step": 30, "error": "x"}]}
    assert objective_of(s, "eval/tiny_mc/acc") == 0.4
    assert objective_of(s, "eval/tiny_mc/f1") is None and objective_of(s, "eval/other/acc") is None
    assert objective_of(s, "validation.loss") == 2.0 and objective_of(s, "final_loss") == 2.5


@pytest.mark.parametrize(("metric", "direction"), [
    ("acc", "maximize"), ("acc_norm", "maximize"), ("exact_match", "maximize"), ("exact_match_strict-match", "maximize"),
    ("f1", "maximize"), ("perplexity", "minimize"), ("word_perplexity", "minimize"), ("bits_per_byte", "minimize"),
    ("byte_perplexity", "minimize"), ("mystery", None)])
def test_eval_metric_directions(metric, direction):
    from loom.schema import objective_direction

    assert objective_direction(f"eval/t/{metric}") == direction


def _base(tasks: list[str], *extra: str):
    """A validated config whose eval.tasks is set afterwards (names that are not tasks: checked by ENGINE's group)."""
    from loom.pipeline import resolve

    cfg = resolve(["hardware=cpu", "hardware.devices=1", *extra])
    cfg.eval.tasks = tasks
    return cfg


def test_sweep_objective_on_an_eval_task_not_in_eval_tasks_is_refused_before_any_trial(tmp_path):
    """Config time: the task must be one eval.tasks evaluates (by name, or a listed YAML's `task:`): validation
    refuses it (`loom train`, `--cfg job`, each trial), and so does the sweep before its first trial."""
    from loom.pipeline import resolve
    from loom.schema import objective_problem
    from loom.sweep import run_sweep
    from loom.validate import evaluated_tasks

    def never(*_):
        raise AssertionError("no trial may be resolved or run")

    with pytest.raises(ConfigError, match="ranks by task 'tiny_mc', but eval.tasks is empty") as e:
        resolve(["hardware=cpu", "sweep.objective=eval/tiny_mc/acc"])
    assert "eval.tasks='[tiny_mc]'" in str(e.value)
    base = _base(["tiny_ppl"], f"run.root={tmp_path}")
    base.sweep.objective = "eval/tiny_mc/acc"
    with pytest.raises(ConfigError, match=r"ranks by task 'tiny_mc', but eval.tasks is \['tiny_ppl'\]"):
        run_sweep(["optim.lr=0.1,0.2"], base, never, never)
    yaml_task = _local_task(tmp_path / "tasks", 3)  # `task: tiny_mc` in a YAML eval.tasks lists, or its folder
    for entry in (str(yaml_task), str(yaml_task.parent)):
        assert objective_problem("eval/tiny_mc/acc", *evaluated_tasks(_base([entry]))) is None
    assert objective_problem("eval/tinycode_mc/acc", *evaluated_tasks(_base(["tinycode_mc"]))) is None
    assert "not a summary.json metric" in objective_problem("eval/acc", ["tiny_mc"], {"tiny_mc"})


def test_sweep_direction_of_an_eval_objective(capsys):
    """The metric's direction unless the command says one; a metric not in the table needs it said."""
    from loom.sweep import sweep_objective

    base = _base(["tiny_mc"])
    base.sweep.objective = "eval/tiny_mc/acc"
    assert sweep_objective(base, ["optim.lr"], ["sweep.objective=eval/tiny_mc/acc"]) == ("eval/tiny_mc/acc", "maximize")
    with open_dict(base):
        base.sweep.direction = "minimize"
    assert sweep_objective(base, ["strategy"], ["sweep.direction=minimize"])[1] == "minimize"
    base.sweep.objective = "eval/tiny_mc/mystery"
    with pytest.raises(ConfigError, match="sweep.direction=maximize or sweep.direction=minimize"):
        sweep_objective(base, ["optim.lr"], [])


def _local_task(d: Path, n: int) -> Path:
    """A local multiple-choice task: `dataset_path: json` over n JSONL documents of 3 choices."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"query": f"q{i} " + "x" * 40, "choices": ["a", "b", "c"], "gold": 0} for i in range(n)]
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = d / "mc.yaml"
    path.write_text("task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: mc.jsonl\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: !function utils.text\n"
                    "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\n")
    return path


def test_plan_says_what_evaluation_costs(tmp_path):
    """Every 50 of 200 steps (the end among them): 4 evaluations; the local task's 12 documents counted,
    3 requests each; a registry task under eval.limit=7: 7 x 4 choices assumed; seconds = forward FLOPs
    (a third of training's per token) over the plan's rate; the row in the table and plan.json."""
    from loom.eval import model_context
    from loom.plan import Plan, make_plan
    from loom.plan.evaluation import FORWARD_SHARE, cost_line, evaluations

    cfg = _base([str(_local_task(tmp_path, 12)), "hellaswag"], "trainer.max_steps=200", "eval.every_n_steps=50")
    plan = make_plan(cfg)
    ev = plan.evaluation
    assert ev["evaluations"] == 4 and ev["tasks"][str(tmp_path / "mc.yaml")]["documents"] == 12
    assert ev["tasks"][str(tmp_path / "mc.yaml")]["requests"] == 36 and not ev["tasks"][str(tmp_path / "mc.yaml")]["assumed"]
    assert ev["tasks"]["hellaswag"]["assumed"] and "hellaswag: 1000 documents assumed" in cost_line(ev)
    expected = ev["tokens_per_evaluation"] * plan.flops_per_token * FORWARD_SHARE / ev["rate_flops"]
    assert ev["seconds_per_evaluation"] == pytest.approx(expected) and ev["seconds"] == pytest.approx(4 * expected)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).evaluation == ev
    cfg.eval.limit = 7
    ev = make_plan(cfg).evaluation
    assert ev["tasks"]["hellaswag"] == {"documents": 7, "requests": 28, "tokens": 28 * min(model_context(cfg), 256),
                                        "assumed": False}
    assert ev["tasks"][str(tmp_path / "mc.yaml")]["documents"] == 7
    assert f"4 evaluation(s) x {ev['requests_per_evaluation']:,} requests" in cost_line(ev)
    assert (evaluations(200, 0, True), evaluations(200, 60, True), evaluations(200, 60, False)) == (1, 4, 3)
    cfg.eval.tasks = []
    assert make_plan(cfg).evaluation is None


def test_plan_counts_the_shipped_tasks_of_a_composed_config(capsys):
    """`eval.tasks=[tinycode_mc,tinycode_ppl]` composed and validated as `loom plan` does: the shipped
    documents counted (150 of 4 choices, 75 texts), the row in the plan's table."""
    from loom.pipeline import plan_run, resolve

    cfg = resolve(["hardware=cpu", "eval.tasks=[tinycode_mc,tinycode_ppl]", "eval.every_n_steps=100",
                   "trainer.max_steps=200"])
    plan = plan_run(cfg, show=True)
    ev = plan.evaluation
    assert ev["evaluations"] == 2 and ev["requests_per_evaluation"] == 150 * 4 + 75
    assert {t: c["documents"] for t, c in ev["tasks"].items()} == {"tinycode_mc": 150, "tinycode_ppl": 75}
    assert "2 evaluation(s) x 675 requests" in " ".join(capsys.readouterr().out.split())


def test_a_trial_is_scored_by_its_newest_evaluation_or_said_to_have_none(tmp_path, capsys):
    """The sweep's own read of a trial (manifest `objective`): eval/step-N.json files count; a completed
    trial whose evaluations all failed has none, and the sweep says so."""
    from loom.report import report
    from loom.rundir.paths import RunDir
    from loom.sweep import Trial, trial_objective

    scored = _run_dir(tmp_path, "a", [_result(10, 0.3)])
    RunDir(scored).evals.mkdir()
    RunDir(scored).eval_result(30).write_text(json.dumps(_result(30, 0.45, source="checkpoint")))
    assert trial_objective(Trial(0, []), scored, "eval/tiny_mc/acc") == 0.45
    failed = _run_dir(tmp_path, "b", [{"step": 30, "error": "ValueError: bad"}])
    assert trial_objective(Trial(1, []), failed, "eval/tiny_mc/acc") is None
    assert "[sweep] trial 1: its summary has no eval/tiny_mc/acc (no evaluation scored it" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--direction maximize or --direction minimize"):
        report([str(tmp_path)], objective="eval/tiny_mc/mystery")
