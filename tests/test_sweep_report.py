"""Sweeps that name the winner, and validation shown: one 1-process lr sweep (killed once after
its first trial and resumed: the sweep's resume checks; then ranked by throughput and back, training
nothing), one classifier run (resumed once) and a
text corpus too small for a validation split serve every check here."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FAST, launching_fixture, refused, run_loom, start_loom

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 3
SWEEP = ("train", "-m", "optim.lr=1e-4,1e-2", "strategy=single", *FAST, f"trainer.max_steps={STEPS}")
DIGITS = ("train", "dataset=digits", "model=mlp", "strategy=single", "tracking=csv", "trainer.max_steps=5",
          "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2")


def _manifest(root: Path) -> dict:
    (path,) = root.glob("gpt/sweeps/*/manifest.json")
    return json.loads(path.read_text())


def _kill_after_trial_0(root: Path) -> dict:
    """Start the sweep; once trial 0 is completed (trial 1 then starting or running), SIGKILL the
    whole process group. Returns the manifest the kill left."""
    proc = start_loom(*SWEEP, root=root, start_new_session=True)
    deadline = time.monotonic() + 400
    while True:
        manifests = list(root.glob("gpt/sweeps/*/manifest.json"))
        if manifests and json.loads(manifests[0].read_text())["trials"][0]["state"] == "completed":
            break
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "trial 0 never completed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return _manifest(root)


@launching_fixture(scope="module")
def sweep(tmp_path_factory) -> SimpleNamespace:
    """The lr sweep, SIGKILLed after trial 0 and resumed by the same command (which trains trial
    1 only), then run a third time (which trains nothing)."""
    root = tmp_path_factory.mktemp("lr_sweep")
    killed = _kill_after_trial_0(root)
    r = run_loom(*SWEEP, root=root, timeout=400)
    assert r.rc == 0, r.out + r.err
    (manifest_path,) = root.glob("gpt/sweeps/*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    # the same sweep ranked by another objective: the same sweep dir, nothing trains, the trials re-ranked
    reranked = run_loom(*SWEEP, "sweep.objective=throughput.tokens_per_sec", "sweep.direction=maximize", root=root,
                        timeout=600)
    assert len(list(root.glob("gpt/sweeps/*/manifest.json"))) == 1
    reranked_manifest = json.loads(manifest_path.read_text())
    third = run_loom(*SWEEP, root=root, timeout=600)  # and back: the command as it was, nothing trains
    summaries = {float(t["params"]["optim.lr"]): json.loads((Path(t["run_dir"]) / "summary.json").read_text())
                 for t in manifest["trials"]}
    return SimpleNamespace(r=r, root=root, dir=manifest_path.parent, manifest=manifest, summaries=summaries,
                           killed=killed, third=third, reranked=reranked, reranked_manifest=reranked_manifest)


def test_sweep_resumes_after_a_kill_and_reruns_nothing(sweep):
    assert sweep.killed["trials"][0]["state"] == "completed"
    assert [t["state"] for t in sweep.killed["trials"][1:]] in ([], ["pending"], ["running"])
    assert "trial 0 already completed" in sweep.r.out
    m = sweep.manifest
    assert [t["state"] for t in m["trials"]] == ["completed", "completed"]
    assert [t["overrides"][-1] for t in m["trials"]] == ["optim.lr=0.0001", "optim.lr=0.01"]
    run_dirs = sorted(p for p in Path(m["trials"][0]["run_dir"]).parent.iterdir() if (p / "config.yaml").exists())
    assert len(run_dirs) == 2  # exactly one run dir per trial
    for t in m["trials"]:
        s = json.loads((Path(t["run_dir"]) / "summary.json").read_text())
        assert s["status"] == "completed" and s["world_size"] == 1 and s["strategy"] == "single"
    assert "tokens/s" in sweep.r.out  # the report table
    assert (run_dirs[0].parent / "report.md").exists()
    assert sweep.third.rc == 0 and sweep.third.out.count("already completed") == 2
    assert "Starting run" not in sweep.third.out and "Resuming run" not in sweep.third.out


def _table_header(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if "┃ run" in line)
    return [c.strip() for c in line.split("┃")[1:-1]]


def test_sweep_table_has_the_lr_column_losses_and_the_best_trial(sweep):
    header = _table_header(sweep.r.out)
    assert header[:7] == ["run", "status", "optim.lr", "train loss", "val loss", "final_loss ↓", "best"], header
    assert "eff." not in header  # both trials have world size 1: no scaling efficiency
    best_lr = min(sweep.summaries, key=lambda lr: sweep.summaries[lr]["final_loss"])
    best = sweep.summaries[best_lr]
    line = next(x for x in sweep.r.out.splitlines() if x.startswith("best trial: "))
    assert line.startswith(f"best trial: optim.lr={best_lr:g} (final_loss {best['final_loss']:.4f}, the lowest)")
    rows = [[c.strip() for c in x.split("│")[1:-1]] for x in sweep.r.out.splitlines() if x.startswith("│")]
    table = {row[2]: row for row in rows if len(row) == len(header)}
    assert set(table) == {"0.0001", "0.01"}
    for lr, s in sweep.summaries.items():
        row = table[f"{lr:g}"]
        assert row[3] == f"{s['final_loss']:.4f}" and row[4] == f"{s['validation']['loss']:.4f}"
        assert row[6] == ("★" if lr == best_lr else "")
    assert sweep.manifest["objective"] == "final_loss" and sweep.manifest["direction"] == "minimize"


def test_each_log_line_is_printed_once_in_a_one_process_sweep(sweep):
    """The resumed sweep trained trial 1 only (the optuna sweep of tests/test_sweep.py checks
    the lines of several trials in one process)."""
    out = sweep.r.out
    assert out.count("training loop started at step 0") == 1
    assert len(re.findall(r"^dataset tinycode: ", out, re.M)) == 1
    lines = out.splitlines()
    assert not [a for a, b in zip(lines, lines[1:], strict=False) if a == b and a.startswith("step ")]


def test_sweep_report_plots_the_objective_against_lr(sweep):
    png = sweep.dir / "objective_vs_optim.lr.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert not (sweep.dir / "scaling.png").exists()  # equal world sizes: no scaling plot
    md = (sweep.dir / "report.md").read_text()
    assert "![objective_vs_optim.lr](objective_vs_optim.lr.png)" in md and "best trial: optim.lr=" in md
    assert "| optim.lr |" in md and "scaling eff." not in md
    again = run_loom("report", str(sweep.dir), root=sweep.root)  # `loom report <sweep dir>` says the same
    assert again.rc == 0 and "best trial: optim.lr=" in again.out and f"plot: {png}" in again.out


def test_report_of_run_dirs_goes_to_the_current_directory(sweep, tmp_path):
    a, b = (t["run_dir"] for t in sweep.manifest["trials"])
    r = run_loom("report", a, b, root=tmp_path)  # cwd: tmp_path
    assert r.rc == 0, r.out + r.err
    assert (tmp_path / "report.md").is_file() and f"report: {tmp_path / 'report.md'}" in r.out
    assert not (Path(a).parent / "report.md").read_text().startswith("# Comparison")


def test_report_says_why_a_run_failed(sweep, tmp_path):
    """summary.json `error` (written by the worker when it fails) is the report's "why it failed"."""
    run = tmp_path / "failed-run"
    shutil.copytree(sweep.manifest["trials"][0]["run_dir"], run)
    s = json.loads((run / "summary.json").read_text())
    s.update(status="failed", error={"type": "TypeError", "message": "unexpected keyword argument 'widht'",
                                     "rank": 0, "step": 0, "log": str(run / "logs" / "rank-0.log")})
    (run / "summary.json").write_text(json.dumps(s))
    r = run_loom("report", str(run), root=tmp_path)
    why = f"TypeError: unexpected keyword argument 'widht' (rank 0, step 0); full traceback: {run}/logs/rank-0.log"
    assert r.rc == 0 and f"| why it failed | {why} |" in (run / "report.md").read_text()
    assert "why it failed" in r.out and "TypeError" in r.out


def test_validation_is_logged_at_the_last_step_and_in_the_summary(sweep):
    t = sweep.manifest["trials"][-1]  # the trial the resumed sweep trained (its lines are in r.out)
    run_dir = Path(t["run_dir"])
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["validation"]["step"] == s["global_step"] == STEPS
    import csv

    with open(run_dir / "metrics.csv", newline="") as f:
        val_rows = [row for row in csv.DictReader(f) if row.get("val/loss")]
    assert [int(row["step"]) for row in val_rows] == [STEPS]  # not STEPS - 1
    assert s["validation"]["loss"] == pytest.approx(float(val_rows[0]["val/loss"]))
    assert f"validation          │ loss {s['validation']['loss']:.4f} at step {STEPS}" in sweep.r.out
    md = (run_dir / "report.md").read_text()
    assert f"| validation | loss {s['validation']['loss']:.4f} at step {STEPS} |" in md
    assert "| model | gpt_tiny, " in md and " parameters |" in md and "| dataset | tinycode |" in md


@launching_fixture(scope="module")
def digits(tmp_path_factory) -> SimpleNamespace:
    """A classifier run (what a resumed run's first loss is: tests/test_tracking.py's resumed run)."""
    root = tmp_path_factory.mktemp("digits")
    r = run_loom(*DIGITS, root=root, timeout=600)
    assert r.rc == 0, r.out + r.err
    return SimpleNamespace(r=r)


def test_a_classifier_reports_samples_per_second_and_no_tokens(digits):
    r = digits.r
    s = r.summary()
    assert s["throughput"]["tokens_per_sec"] is None and s["throughput"]["samples_per_sec"] > 0
    assert "tokens/s" not in r.out and "tok/s" not in r.out
    assert re.search(r"^step 5/5 .* samples/s ", r.out, re.M)
    assert set(s["validation"]) == {"loss", "acc", "step"} and 0 <= s["validation"]["acc"] <= 1
    assert re.search(r"validation +│ loss \d\.\d{4}, acc \d\.\d{4} at step 5", r.out)
    assert re.search(r"^dataset digits: .*1,438 train / 359 val samples", r.out, re.M)
    report = run_loom("report", str(r.run_dir), root=r.run_dir.parent)
    md = (r.run_dir / "report.md").read_text()
    assert report.rc == 0 and "| samples/s |" in md and "tokens/s" not in md and "| tokens |" not in md
    assert "| model | mlp, " in md


def _corpus(tmp_path: Path) -> str:
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return f"dataset.paths=[{tmp_path}/*.txt]"


@pytest.mark.launch
def test_three_text_files_hold_out_windows_and_warn_of_a_split_smaller_than_a_batch(tmp_path):
    """Fewer files than dataset.val_every: validation is every k-th window, not every 20th file
    (none of 3); a val_fraction whose windows make less than one batch is warned about."""
    r = run_loom("train", "dataset=text_files", _corpus(tmp_path), "strategy=single", "tracking=csv",
                 "trainer.max_steps=1", "dataset.seq_len=32", "dataset.batch_size=4", "dataset.val_fraction=0.01",
                 root=tmp_path, timeout=200)
    assert r.rc == 0, r.out + r.err
    m = re.search(r"^dataset text_files: 3 file\(s\) from .*, 8,\d{3} tokens -> (\d+) train / (\d+) val windows", r.out,
                  re.M)
    assert m and int(m[2]) == (int(m[1]) + int(m[2])) // 100 > 0, r.out
    assert (f"warning: dataset=text_files: the validation split has {m[2]} sample(s)/window(s), fewer than one "
            "batch per data-parallel rank") in r.out
    assert r.summary()["validation"] is None and "validation          │ none" in r.out


def test_periodic_validation_over_an_empty_split_is_refused(loom, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    err = refused(tmp_path, "dataset=text_files", _corpus(corpus), "dataset.val_every=0", "trainer.val_every_n_steps=5")
    assert "trainer.val_every_n_steps=5" in err and "validation split is empty" in err
    assert "dataset.val_every=0 turns it off" in err


# ------------------------------------------------------------------ sweeps that say what differs
# Trial run dirs written here as the worker writes them (summary.json from rundir.summary's own
# template, metrics.csv with the recorder's columns) under a sweep dir whose manifest is the
# sweep's own Manifest: the report's tie rule, ranking, titles and plots, in-process.


def _trial(sweep_dir: Path, name: str, losses: list[float], rate: float, mem_gb: float,
           resumed_from: int | None = None, strategy: str = "ddp") -> Path:
    """A completed 2-rank trial whose train/loss was `losses` at steps 1..n (one per log step)."""
    from loom.pipeline import resolve
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = resolve(["hardware=cpu", "hardware.devices=2"])
    run = sweep_dir / name
    run.mkdir(parents=True)
    s = empty_summary(cfg, name, layout_of(cfg))
    s.update(status="completed", global_step=len(losses), final_loss=losses[-1], resumed_from_step=resumed_from,
             strategy=strategy)
    s["throughput"].update(tokens_per_sec=rate, samples_per_sec=rate / 64, steady=True)
    s["memory"]["peak_rss_gb_per_rank"] = [mem_gb, mem_gb - 0.01]
    (run / "summary.json").write_text(json.dumps(s))
    rows = ["step,train/loss,perf/tokens_per_sec,val/loss"]
    rows += [f"{i},{loss!r},{rate!r}," for i, loss in enumerate(losses, 1)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run


def _sweep_of(sweep_dir: Path, trials: dict[str, Path], objective: str = "final_loss") -> None:
    """manifest.json, written by the sweep's own Manifest: one completed trial per swept value."""
    from loom.sweep import Manifest, Trial

    m = Manifest(sweep_dir / "manifest.json", "t", ["-m"], objective, "minimize")
    for i, (override, run) in enumerate(trials.items()):
        key, _, value = override.partition("=")
        m.trials.append(Trial(i, [override], "completed", run.name, str(run), 0, None, None, {key: value}))
    m.save()


def _curve(final: float, scatter: float, n: int = 10) -> list[float]:
    """A loss falling 0.1 per step to `final`, each step `scatter` above or below the trend."""
    return [final + 0.1 * (n - i) + (scatter if i % 2 else -scatter) for i in range(1, n + 1)]


def _noise(curve: list[float]) -> float:
    """The tie rule's noise of a trial: its last 8 values' successive differences, std / sqrt(2)."""
    import statistics

    tail = curve[-8:]
    return statistics.stdev([b - a for a, b in zip(tail, tail[1:], strict=False)]) / 2 ** 0.5


def _report(sweep_dir: Path, capsys, monkeypatch) -> tuple[str, str]:
    from loom.report import report

    monkeypatch.setenv("COLUMNS", "250")
    assert report([str(sweep_dir)]) == 0
    return capsys.readouterr().out, (sweep_dir / "report.md").read_text()


def test_a_strategy_sweep_whose_losses_tie_stars_none_and_ranks_by_throughput(tmp_path, capsys, monkeypatch):
    """ddp, fsdp and zero2 end 3e-7 apart (summation order), well inside their step-to-step
    noise: no ★, the report says they tie, ranks them by tokens/s then memory, titles them by
    their overrides, marks the resumed one and draws throughput and memory per trial."""
    curve = _curve(4.9, 0.02)
    runs = {"strategy=ddp": _trial(tmp_path, "aaa", curve, 6000.0, 0.90),
            "strategy=fsdp": _trial(tmp_path, "bbb", [*curve[:-1], curve[-1] + 2e-7], 5000.0, 0.60, strategy="fsdp"),
            "strategy=zero2": _trial(tmp_path, "ccc", [*curve[:-1], curve[-1] - 1e-7], 5500.0, 0.70, resumed_from=4,
                                     strategy="zero2")}
    _sweep_of(tmp_path, runs)
    out, md = _report(tmp_path, capsys, monkeypatch)

    noise = _noise(curve)
    assert 0.02 < noise < 0.04  # the scatter, not the trend (a plain std of the values would be ~0.25)
    line = (f"no best trial: all 3 completed trials tie on final_loss (spread 3e-07, within {2 * noise:.2g}: "
            f"2 x the trials' step-to-step noise {noise:.2g}); ranked by throughput, then peak memory: "
            "1. strategy=ddp (6,000 tokens/s, 0.90 GB RSS), 2. strategy=zero2 ↻ (5,500 tokens/s, 0.70 GB RSS), "
            "3. strategy=fsdp (5,000 tokens/s, 0.60 GB RSS)")
    assert line in out.splitlines() and line in md
    assert "★" not in out and "★" not in md
    assert not [x for x in out.splitlines() if x.startswith("best trial:")]
    header = _table_header(out)
    rows = {r[0]: r for r in ([c.strip() for c in x.split("│")[1:-1]] for x in out.splitlines() if x.startswith("│"))
            if len(r) == len(header)}
    assert set(rows) == {"strategy=ddp", "strategy=fsdp", "strategy=zero2 ↻"}  # overrides, not run ids
    best, rank = header.index("best"), header.index("rank")
    assert {k: (r[best], r[rank]) for k, r in rows.items()} == {
        "strategy=ddp": ("tied", "1"), "strategy=zero2 ↻": ("tied", "2"), "strategy=fsdp": ("tied", "3")}
    assert "↻: strategy=zero2 resumed from step 4." in md
    assert "No objective plot: the trials tie on final_loss." in md
    assert not (tmp_path / "objective_vs_strategy.png").exists()  # a flat row of dots is not drawn
    assert (tmp_path / "trials.png").read_bytes()[:8] == PNG_SIGNATURE and "![trials](trials.png)" in md
    assert "- strategy=zero2 ↻: [ccc](ccc/report.md)" in md


def test_trials_png_draws_each_trials_throughput_and_memory_under_its_overrides(tmp_path):
    from loom.report import collect
    from loom.report.compare import comparison_report, read_sweep, trial_bars
    from loom.report.sweep_plots import RESUMED_HATCH, trials_figure

    runs = {"strategy=ddp": _trial(tmp_path, "aaa", _curve(4.9, 0.0), 6000.0, 0.90),
            "strategy=zero2": _trial(tmp_path, "ccc", _curve(4.9, 0.0), 5500.0, 0.70, resumed_from=4)}
    _sweep_of(tmp_path, runs)
    found, sweep_dir, _ = collect([tmp_path])
    sweep = read_sweep(sweep_dir)
    comparison_report(found, tmp_path, [], sweep)  # sorts the runs as the table shows them
    bars, unit, kind = trial_bars(found, sweep)
    fig = trials_figure(bars, unit, kind)
    rate_ax, mem_ax = fig.axes
    for ax, values in ((rate_ax, [6000.0, 5500.0]), (mem_ax, [0.90, 0.70])):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["strategy=ddp", "strategy=zero2 (resumed)"]
        assert [p.get_height() for p in ax.patches[:2]] == pytest.approx(values)
        assert [p.get_hatch() or "" for p in ax.patches[:2]] == ["", RESUMED_HATCH]
    assert (rate_ax.get_ylabel(), mem_ax.get_ylabel()) == ("tokens/s", "GB (RSS)")


def test_losses_apart_beyond_their_noise_keep_the_star(tmp_path, capsys, monkeypatch):
    """0.03 apart (0.75%, beyond the 0.1% summation-order floor): a tie when each trial's loss
    scatters 0.05 from step to step, a winner when the curves are smooth."""
    noisy, smooth = tmp_path / "noisy", tmp_path / "smooth"
    for root, scatter in ((noisy, 0.05), (smooth, 0.0)):
        _sweep_of(root, {"optim.lr=0.001": _trial(root, "aaa", _curve(4.03, scatter), 6000.0, 0.9),
                         "optim.lr=0.01": _trial(root, "bbb", _curve(4.00, scatter), 6000.0, 0.9)})
    out, _ = _report(noisy, capsys, monkeypatch)
    noise = _noise(_curve(4.0, 0.05))
    assert (f"no best trial: all 2 completed trials tie on final_loss (spread 0.03, within {2 * noise:.2g}: "
            f"2 x the trials' step-to-step noise {noise:.2g}); ranked by throughput") in out
    out, md = _report(smooth, capsys, monkeypatch)
    assert f"best trial: optim.lr=0.01 (final_loss 4.0000, the lowest): {smooth / 'bbb'}" in out
    assert (smooth / "objective_vs_optim.lr.png").exists() and "No objective plot" not in md


def test_without_a_noise_estimate_only_summation_order_ties(tmp_path, capsys, monkeypatch):
    """A 3-step trial logs too few losses to measure its noise: 0.1% of the value decides."""
    _sweep_of(tmp_path, {"strategy=ddp": _trial(tmp_path, "aaa", [5.0, 4.5, 4.0], 6000.0, 0.9),
                         "strategy=fsdp": _trial(tmp_path, "bbb", [5.0, 4.5, 4.003], 7000.0, 0.8)})
    out, _ = _report(tmp_path, capsys, monkeypatch)
    assert ("no best trial: all 2 completed trials tie on final_loss (spread 0.003, within 0.004: 0.1% of the "
            "value: float summation order); ranked by throughput, then peak memory: 1. strategy=fsdp") in out
    (tmp_path / "bbb" / "summary.json").write_text((tmp_path / "bbb" / "summary.json").read_text().replace(
        "4.003", "4.005"))
    out, _ = _report(tmp_path, capsys, monkeypatch)
    assert "best trial: strategy=ddp (final_loss 4.0000, the lowest)" in out


@pytest.mark.slow
def test_three_strategies_parity_runs_tie_when_ranked_by_final_loss(shared, tmp_path, capsys, monkeypatch):
    """The real files: the shared 2-rank parity runs of ddp, fsdp and zero2 (test_strategies'; no
    new launch), gathered as a sweep ranked by final_loss, tie (their losses agree far inside
    their step-to-step noise) and are ranked by the tokens/s and memory the runs measured."""
    from conftest import strategy_args

    runs: dict[str, Path] = {}
    for s in ("ddp", "fsdp", "zero2"):
        r = shared.get(*strategy_args(s))
        assert r.rc == 0, r.out + r.err
        runs[f"strategy={s}"] = Path(shutil.copytree(r.run_dir, tmp_path / s, ignore=shutil.ignore_patterns(
            "checkpoints", "final", "wandb", "profile")))
    _sweep_of(tmp_path, runs)
    out, md = _report(tmp_path, capsys, monkeypatch)
    summaries = {k: json.loads((p / "summary.json").read_text()) for k, p in runs.items()}
    fastest = max(summaries, key=lambda k: summaries[k]["throughput"]["tokens_per_sec"])
    line = next(x for x in out.splitlines() if x.startswith("no best trial: "))
    assert line.startswith("no best trial: all 3 completed trials tie on final_loss (spread "), line
    assert f"ranked by throughput, then peak memory: 1. {fastest} (" in line
    assert "★" not in md and (tmp_path / "trials.png").is_file()


def _timed(run: Path, mean_s: float, noise_s: float, steps: int) -> Path:
    """The trial's last attempt timed `steps` steps of `mean_s` seconds scattering `noise_s` (loom.tracking.clock)."""
    s = json.loads((run / "summary.json").read_text())
    s["attempts"] = [{"start_step": 0, "timed_steps": steps, "step_s_mean": mean_s, "step_s_noise": noise_s}]
    (run / "summary.json").write_text(json.dumps(s))
    return run


def test_a_rate_sweep_of_a_few_steps_stars_a_trial_only_beyond_its_step_noise(tmp_path, capsys, monkeypatch):
    """A 5-step strategy sweep logs one window per trial, too few for a noise estimate: the 0.1% floor
    alone starred 1% apart. Each trial's per-step seconds (4 timed steps, 5% scatter) put the mean
    rate's noise at ~3.5%: a tie, ranked by memory; the same 1% from 400 steps of 0.5% scatter
    (0.035%) is a real difference: starred."""
    for name, steps, noise in (("few", 4, 0.005), ("many", 400, 0.0005)):
        root = tmp_path / name
        _sweep_of(root, {"strategy=ddp": _timed(_trial(root, "aaa", [4.0], 6000.0, 0.9), 0.1, noise, steps),
                         "strategy=zero2": _timed(_trial(root, "bbb", [4.0], 6060.0, 0.8), 0.099, noise, steps)},
                  objective="throughput.tokens_per_sec")
        m = json.loads((root / "manifest.json").read_text())
        (root / "manifest.json").write_text(json.dumps({**m, "direction": "maximize"}))
    out, _ = _report(tmp_path / "few", capsys, monkeypatch)
    se = 6060.0 * 0.005 / 0.099 / 2 * 2 ** 0.5
    assert ("no best trial: all 2 completed trials tie on throughput.tokens_per_sec (spread 60, within "
            f"{2 * se:.2g}: 2 x the trials' noise of a difference of their mean rates (per-step seconds) {se:.2g})") in out
    assert "ranked by peak memory, then throughput: 1. strategy=zero2" in out, out
    out, _ = _report(tmp_path / "many", capsys, monkeypatch)
    assert "best trial: strategy=zero2 (throughput.tokens_per_sec 6,060.0, the highest)" in out, out


def test_report_re_ranks_a_sweep_by_another_objective_without_training(sweep, capsys, monkeypatch):
    """`loom report SWEEP --objective throughput.tokens_per_sec` ranks the finished lr trials by tokens/s
    (maximized by default); an unknown metric, --direction alone, or --objective on a run dir exit 2. The
    fixture's third run changed only sweep.objective: the same sweep dir, nothing trained, re-ranked."""
    from loom.errors import ConfigError
    from loom.report import report

    monkeypatch.setenv("COLUMNS", "250")
    assert report([str(sweep.dir)], objective="throughput.tokens_per_sec") == 0
    out = capsys.readouterr().out
    assert "throughput.tokens_per_sec ↑" in _table_header(out), out
    assert ("best trial: optim.lr=" in out or "no best trial: all 2 completed trials tie on throughput" in out), out
    for kwargs, says in (({"objective": "loss"}, "not a summary.json metric"),
                         ({"direction": "maximize"}, "--direction goes with --objective")):
        with pytest.raises(ConfigError, match=says):
            report([str(sweep.dir)], **kwargs)
    with pytest.raises(ConfigError, match="not a sweep dir"):
        report([sweep.manifest["trials"][0]["run_dir"]], objective="validation.loss")
    r = sweep.reranked
    assert r.rc == 0 and r.out.count("already completed") == 2 and "Starting run" not in r.out, r.out
    m = sweep.reranked_manifest
    assert (m["objective"], m["direction"], m["sweep_id"]) == ("throughput.tokens_per_sec", "maximize",
                                                              sweep.manifest["sweep_id"])  # not a new sweep
    assert [t["objective"] for t in m["trials"]] == [s["throughput"]["tokens_per_sec"] for s in sweep.summaries.values()]
