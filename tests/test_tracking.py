"""Tracking that tells the truth: throughput bracketed by an independent stopwatch, MFU, one wandb
and one MLflow run per Loom run (also across a resume), TensorBoard events, no secrets in the run
dir or the MLflow store, reports and plots.

Real trainings are slow on 2 cores, so shared runs serve many checks:
  ddp_run      the default 2-rank job, tracking=offline (wandb offline + CSV) with TensorBoard and
               MLflow (the run root's local store) on too, steps 3-4 profiled, secrets in the
               environment: DDP_ARGS, shared with tests/test_e2e.py and tests/test_profile.py
               (one launch for all three)
  single_run   the parity suite's `single` reference (tests/conftest.py); with ddp_run it forms
               a 2-run "sweep" dir for the report
  resumed_run  a copy of ddp_run marked as killed, then resumed by the same command
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FAST, LOOM, killed_copy, launching_fixture, refused, run_loom

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SENTINELS = {"WANDB_API_KEY": "sentinel-1234567890abcdef", "LOOM_TEST_SERVICE_TOKEN": "sentinel-token-0987654321"}
STEPS, CKPT_EVERY = 12, 5     # the last checkpoint (step 10) is not the last step: see the stopwatch
MICRO_BATCH, SEQ_LEN = 16, 128
PROFILED = (3, 5)             # trainer.profile.steps: steps 3 and 4 (tests/test_profile.py)
EVAL_EVERY = 8                # eval.tasks=[tinycode_mc] at steps 8 and 12 (tests/test_eval_loop.py)
BASE = [o for o in FAST if not o.startswith(("tracking=", "checkpoint."))]
# The default job (ddp, 2 ranks, gpt_tiny on tinycode) with every metric logged at every step, and
# benchmark evaluation in the loop.
DDP_ARGS = (*BASE, "tracking=offline", f"trainer.max_steps={STEPS}", f"checkpoint.every_n_steps={CKPT_EVERY}",
            "trainer.limit_val_batches=2", "tracking.tensorboard=true", "tracking.mlflow.enabled=true",
            f"trainer.profile.steps=[{PROFILED[0]},{PROFILED[1]}]", "trainer.profile.memory=true",
            "eval.tasks=[tinycode_mc]", f"eval.every_n_steps={EVAL_EVERY}", "eval.limit=20")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tracking")


@launching_fixture(scope="module")
def ddp_run(shared):
    r = shared.get(*DDP_ARGS, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    plots = sorted(p.name for p in (r.run_dir / "plots").glob("*.png")) if (r.run_dir / "plots").is_dir() else []
    return SimpleNamespace(result=r, run_dir=r.run_dir, root=r.run_dir.parents[1], plots_after_train=plots)


@launching_fixture(scope="module")
def resumed_run(root, ddp_run):
    """ddp_run's dir, copied to another root and marked the way a killed run is left
    (status failed: the launcher writes that; no first_loss or validation: the launcher's failure
    summary has none), resumed by the same command."""
    copy = killed_copy(ddp_run.run_dir, ddp_run.root, root, first_loss=None, validation=None)
    r = run_loom("train", *DDP_ARGS, root=root, env=SENTINELS)
    assert r.rc == 0, r.out + r.err
    assert r.run_dir == copy
    return r


# ----------------------------------------------------------------------------- helpers


def _log_times(run_dir: Path) -> dict[str, float]:
    """Timestamps (wall clock, written by Python's logging) of rank 0's loop lines."""
    times: dict[str, float] = {}
    pat = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank 0\] (\S+) \w+: (.*)$")
    for line in (run_dir / "logs" / "rank-0.log").read_text().splitlines():
        m = pat.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        msg = m.group(3)
        if msg.startswith("training loop started"):
            times["start"] = t
        elif msg.startswith(f"step {STEPS}/{STEPS} "):
            times["last_step"] = t
        elif msg.startswith("training loop ended"):
            times["end"] = t
            loop, val = re.search(r": ([\d.]+) s training, ([\d.]+) s validation, [\d.]+ s checkpoints", msg).groups()
            times["loop_s"], times["val_s"] = float(loop), float(val)
    return times


def _tokens_this_attempt(s: dict) -> int:
    span = s["attempts"][-1]
    return (span["end_step"] - span["start_step"]) * 2 * MICRO_BATCH * SEQ_LEN


def _files(run_dir: Path):
    for dirpath, _dirs, names in os.walk(run_dir):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file():
                yield p


def _assert_png(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, img.shape
    assert img.std() > 0.01, f"{path} is blank"


# ----------------------------------------------------------------------------- throughput


def test_tokens_per_sec_is_over_this_attempts_training_loop(ddp_run):
    """train_time_s, the denominator of every rate, must be the training loop's time: no start-up
    before it, no validation in it, every step in it. Checked by ordering against two independent
    records, never by a ratio of clocks (which a loaded machine skews):
    - a lower bound: each logged row's step_time_ms_min is at most rank 0's own window, and rank 0's
      windows tile the loop up to the last step's log, so their sum cannot exceed train_time_s (a
      denominator that drops steps, or subtracts validation twice, falls below it);
    - an upper bound: the timestamps Python's logging puts on rank 0's "training loop started" and
      "training loop ended" lines (another clock, other code) bracket the loop, so train_time_s
      cannot exceed their difference (one that counts start-up, or the whole process, exceeds it;
      the 50 ms margin covers the 1 ms log resolution and the microseconds between the clock read
      and the log record);
    - the "ended" line's own figures: train_time_s is its training time, validation is beside it."""
    s = ddp_run.result.summary()
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_step"] == STEPS
    tokens = _tokens_this_attempt(s)
    assert tokens == STEPS * 2 * MICRO_BATCH * SEQ_LEN == s["tokens"]
    tps, train_time = s["throughput"]["overall"]["tokens_per_sec"], s["train_time_s"]
    # the overall rate is tokens / train_time_s (train_time_s is rounded to 1 ms)
    assert tps * train_time == pytest.approx(tokens, rel=0.005)
    # the steady rate: the steps after the first logged window (step 1), over their own time
    span = s["attempts"][-1]
    assert s["throughput"]["steady"] and s["throughput"]["steady_from_step"] == 1
    assert span["steady_samples"] == (STEPS - 1) * 2 * MICRO_BATCH
    assert s["throughput"]["tokens_per_sec"] * span["steady_train_s"] == pytest.approx(
        span["steady_samples"] * SEQ_LEN, rel=0.005)
    assert 0 < span["steady_train_s"] < train_time - span["first_step_s"] + 0.002
    t_ = s["time"]
    assert t_["train_s"] == pytest.approx(train_time, abs=0.001) and t_["checkpoint_s"] > 0  # saves at 5, 10, 12
    assert 0 < t_["first_step_s"] < train_time and t_["compile_s"] == 0.0 and t_["validation_s"] > 0
    # not compiled: no compile seen, so every window after the first is steady (test_compile: compiled runs)
    assert s["recompiles"] == {"count": 0, "steps": [], "reasons": []} and span["steady_steps"] == STEPS - 1

    rows = [r for r in ddp_run.result.metrics() if r.get("perf/step_time_ms")]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # log_every_n_steps=1
    assert sum(float(r["perf/step_time_ms_min"]) for r in rows) / 1000 <= train_time + 0.001

    t = _log_times(ddp_run.run_dir)
    assert {"start", "last_step", "end"} <= set(t), t
    assert t["start"] <= t["last_step"] <= t["end"]
    assert train_time <= t["end"] - t["start"] + 0.05, (train_time, t)
    loop, val = t["loop_s"], t["val_s"]
    assert train_time == pytest.approx(loop, abs=0.0015) and val > 0  # end-of-run validation, not counted
    assert s["wall_time_s"] > train_time + val


def _recorder(peak: float | None, world: int = 2):
    from loom.tracking.recorder import Recorder

    return Recorder(log_every=1, samples_per_step=32, seq_len=128, flops_per_token=6e6,
                    peak_flops_per_device=peak, world_size=world)


def test_mfu_null_when_the_device_peak_is_unknown():
    out = _recorder(None).rates(10 * 32, 2.0, None)  # 10 steps of 32 samples in 2 s
    tokens = 10 * 32 * 128
    assert out["tokens_per_sec"] == pytest.approx(tokens / 2.0)
    assert out["samples_per_sec"] == pytest.approx(10 * 32 / 2.0)
    assert out["tflops_per_device"] == pytest.approx(tokens * 6e6 / 2 / 2.0 / 1e12)
    assert out["mfu"] is None


def test_mfu_against_a_known_peak():
    peak = 1e12  # 1 TFLOP/s per device
    out = _recorder(peak).rates(10 * 32, 2.0, peak)
    per_device_flops = 10 * 32 * 128 * 6e6 / 2 / 2.0  # tokens * flops/token / devices / seconds
    assert out["mfu"] == pytest.approx(per_device_flops / peak)
    assert out["mfu"] == pytest.approx(0.06144)  # 40960 tokens * 6 MFLOP / 2 devices / 2 s / 1 TFLOP/s
    assert 0 < out["mfu"] < 1


def test_ddp_run_measures_every_metric(ddp_run):
    rows = ddp_run.result.metrics()
    names = {"train/loss", "train/lr", "perf/step_time_ms", "perf/step_time_ms_min", "perf/step_time_ms_max",
             "perf/data_wait_ms", "perf/samples_per_sec", "perf/tokens_per_sec", "perf/tflops_per_device",
             "sys/cpu_percent", "sys/rss_gb", "sys/rss_gb_max"}
    assert names <= set(rows[0]), set(rows[0])
    last = [r for r in rows if r.get("perf/step_time_ms")][-1]  # the validation's and evaluation's rows follow it
    assert float(last["perf/step_time_ms_min"]) <= float(last["perf/step_time_ms"]) <= float(
        last["perf/step_time_ms_max"])
    assert "perf/mfu" not in rows[0] or not rows[0]["perf/mfu"]  # CPU profile: peak unknown


# ----------------------------------------------------------------------------- wandb


def test_one_wandb_run_per_loom_run_with_two_ranks(ddp_run):
    run = ddp_run.run_dir
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert runs[0].name.endswith(f"-{run.name}")  # the wandb run id is the Loom run id
    assert (runs[0] / f"run-{run.name}.wandb").is_file()
    assert not (ddp_run.root / "wandb").exists()  # nothing in the working directory
    assert "wandb" not in (run / "logs" / "rank-1.log").read_text().lower()


def test_resume_continues_the_same_wandb_run(resumed_run, ddp_run):
    """wandb 0.31 offline writes one offline-run-<time>-<id> dir per attempt; with the id fixed
    to the Loom run id and resume="allow", `wandb sync` appends them to one run."""
    run = resumed_run.run_dir
    s = resumed_run.summary()
    assert s["status"] == "completed" and s["resumed_from_step"] == 10 and s["global_step"] == STEPS
    dirs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2, dirs
    assert all(d.name.endswith(f"-{run.name}") for d in dirs), dirs
    assert all((d / f"run-{run.name}.wandb").is_file() for d in dirs)
    # totals over both attempts: the first trained steps 1-12, this one 11-12 again (from step 10)
    first, this = s["attempts"]
    assert (first["start_step"], first["end_step"], this["start_step"], this["end_step"]) == (0, STEPS, 10, STEPS)
    assert s["steps_trained"] == STEPS + 2 and s["samples"] == (STEPS + 2) * 2 * MICRO_BATCH
    assert s["train_time_s"] == pytest.approx(first["train_s"] + this["train_s"], abs=0.002)
    assert s["train_time_s"] > ddp_run.result.summary()["train_time_s"]
    assert s["throughput"]["overall"]["tokens_per_sec"] * s["train_time_s"] == pytest.approx(
        s["tokens"], rel=0.005)
    steps = [int(r["step"]) for r in resumed_run.metrics() if r.get("train/loss")]
    assert steps == list(range(1, STEPS + 1))  # history kept, redone steps not duplicated


# ----------------------------------------------------------------------------- TensorBoard, MLflow


def test_tensorboard_events_hold_the_step_metrics(ddp_run):
    """<run>/tensorboard/ holds rank 0's event file (one: the other rank writes none), read back
    with TensorBoard's own reader: the metric names and steps of metrics.csv, the same values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((ddp_run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert {"train/loss", "perf/step_time_ms", "perf/tokens_per_sec"} <= set(events.Tags()["scalars"])
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert losses == pytest.approx(ddp_run.result.losses())


def _mlflow(ddp_run):
    """(client, the run's MLflow run) in the run root's local store, by the id in <run>/mlflow.json."""
    import json

    from mlflow import MlflowClient

    record = json.loads((ddp_run.run_dir / "mlflow.json").read_text())
    store = ddp_run.root / "mlruns"
    assert record["tracking_uri"] == f"file:{store}"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(record["tracking_uri"])
    return client, client.get_run(record["run_id"])


def test_mlflow_run_holds_params_metrics_and_summary(ddp_run):
    """One MLflow run in the experiment `gpt` of <run.root>/mlruns: the frozen config as params
    (flattened keys, secrets never in them: test_no_secret...), the step metrics by the names
    metrics.csv uses, and summary.json's numbers as summary/... metrics; it ended FINISHED."""
    client, run = _mlflow(ddp_run)
    exp = client.get_experiment_by_name("gpt")
    assert exp is not None and run.info.experiment_id == exp.experiment_id
    assert len(client.search_runs([exp.experiment_id])) == 1  # one run, not one per rank
    params = run.data.params
    assert params["strategy/name"] == "ddp" and params["trainer/max_steps"] == str(STEPS)
    assert params["tracking/mlflow/enabled"] == "True"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert set(history) == set(range(1, STEPS + 1))
    losses = ddp_run.result.losses()
    assert history[1] == pytest.approx(losses[1])
    s = ddp_run.result.summary()
    assert run.data.metrics["summary/global_step"] == STEPS
    assert "summary/throughput/tokens_per_sec" in run.data.metrics
    assert run.data.tags["loom.run_id"] == ddp_run.run_dir.name
    assert s["status"] == "completed" and run.info.status == "FINISHED"


def test_resume_continues_the_same_mlflow_run(resumed_run, ddp_run):
    """The resumed copy's frozen config names the same store; <run>/mlflow.json (copied with the
    run dir) names the run: the resume logs into it (steps 11-12 again), no second run appears."""
    client, run = _mlflow(ddp_run)
    copy = resumed_run.run_dir / "mlflow.json"
    assert copy.read_text() == (ddp_run.run_dir / "mlflow.json").read_text()
    assert len(client.search_runs([run.info.experiment_id])) == 1
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == sorted([*range(1, STEPS + 1), 11, 12])
    assert "continuing run" in (resumed_run.run_dir / "logs" / "rank-0.log").read_text()


def test_first_loss_on_resume_is_the_runs_not_the_resumed_parts(resumed_run, ddp_run):
    """The resumed attempt trains steps 11-12 only: the summary's first loss is still step 1's
    (from metrics.csv, which the resume keeps), and the validation is the resumed run's last step's."""
    s = resumed_run.summary()
    assert s["resumed_from_step"] == 10
    assert s["first_loss"] == pytest.approx(ddp_run.result.losses()[1])
    assert s["first_loss"] == pytest.approx(ddp_run.result.summary()["first_loss"])
    assert s["validation"]["step"] == STEPS
    # the evaluations: step 8's from the first attempt, step 12's from the resumed one (loom.worker.evaluation)
    assert [e["step"] for e in s["eval"]] == [EVAL_EVERY, STEPS] and all("tasks" in e for e in s["eval"])


def test_no_secret_in_any_file_of_the_run_dir(ddp_run, resumed_run):
    for run in (ddp_run.run_dir, resumed_run.run_dir, ddp_run.root / "mlruns"):
        files = list(_files(run))
        assert any(part in ("wandb", "params") for p in files for part in p.parts)
        for p in files:
            data = p.read_bytes()
            for value in SENTINELS.values():
                assert value.encode() not in data, f"{value} leaked into {p}"


def test_tracking_wandb_without_a_key_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "NETRC")}
    env.update(HOME=str(tmp_path), WANDB_MODE="offline", WANDB_SILENT="true")
    p = subprocess.run([*LOOM, "train", *BASE, "tracking=wandb", "strategy=single", "trainer.max_steps=1", f"run.root={tmp_path / 'runs'}"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "WANDB_API_KEY" in p.stderr and "tracking=offline" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()


def test_tracking_checks_finds_a_netrc_key(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from loom.errors import ConfigError
    from loom.tracking.checks import tracking_checks

    cfg = OmegaConf.create({"tracking": {"name": "wandb", "wandb": True, "csv": True, "mode": "online",
                                         "project": "loom", "entity": None}})
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError, match="WANDB_API_KEY"):
        tracking_checks(cfg)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    tracking_checks(cfg)  # `wandb login` wrote a key: fine
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    tracking_checks(cfg)
    cfg.tracking.mode = "offline"
    monkeypatch.delenv("WANDB_API_KEY")
    tracking_checks(cfg)  # offline needs no key
    cfg.tracking.mode = "sometimes"
    with pytest.raises(ConfigError, match="tracking.mode='sometimes'"):
        tracking_checks(cfg)


def test_checks_import_neither_torch_nor_wandb():
    code = ("import sys, loom.tracking.checks, loom.redaction, loom.report, loom.tracking.plots; "
            "bad = [m for m in ('torch', 'wandb', 'pytorch_lightning', 'matplotlib') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_unwritable_run_root_is_refused(tmp_path):
    """Running as root, chmod cannot make a dir unwritable: a run.root under a regular FILE
    can never be created, whoever runs it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    p = subprocess.run([*LOOM, "train", *BASE, "tracking=csv", "strategy=single", "trainer.max_steps=1",
                        f"run.root={blocker / 'runs'}"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "run.root" in p.stderr and "Traceback" not in p.stderr


class _FullDiskRun:
    """Stands in for a wandb Run whose files sit on a full disk."""

    def __init__(self) -> None:
        self.calls = 0
        self.finished = None
        self.config = SimpleNamespace(update=self._fail)

    def _fail(self, *a, **k):
        self.calls += 1
        raise OSError(28, "No space left on device")

    log = _fail

    def finish(self, exit_code=0):
        self.finished = exit_code


def test_wandb_failure_degrades_to_one_warning(caplog):
    from loom.tracking.loggers import SafeWandbLogger

    fake = _FullDiskRun()
    logger = SafeWandbLogger(experiment=fake, save_dir=".", id="abc")
    with caplog.at_level("WARNING", logger="loom"):
        logger.log_metrics({"train/loss": 1.0}, step=1)
        logger.log_metrics({"train/loss": 0.9}, step=2)
        logger.log_hyperparams({"a": 1})
        logger.finalize("success")
    assert logger.disabled and fake.calls == 1  # disabled after the first failure
    warnings = [r for r in caplog.records if "wandb" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert fake.finished is None

    ok = _FullDiskRun()
    ok.log = lambda *a, **k: None
    logger = SafeWandbLogger(experiment=ok, save_dir=".", id="abc")
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.finalize("success")
    assert not logger.disabled and ok.finished == 0
    assert "anonymous" not in logger._wandb_init


def test_wandb_settings_record_no_metadata():
    from loom.tracking.loggers import wandb_settings

    s = wandb_settings()
    assert s.x_disable_meta and s.disable_git and not s.save_code and s.x_disable_machine_info


@pytest.mark.parametrize(("choice", "loggers"), [
    ("none", []), ("csv", ["RunCSVLogger"]), ("tensorboard", ["RunCSVLogger", "SafeTensorBoardLogger"]),
    ("mlflow", ["RunCSVLogger", "SafeMLFlowLogger"])])
def test_the_loggers_each_tracking_choice_gives_the_trainer(tmp_path, choice, loggers):
    """README: `tracking=none` logs no step anywhere, `tracking=csv` only metrics.csv,
    tensorboard and mlflow add theirs (what the worker hands Lightning; tracking=none's run is
    test_hydra_cli's exact-dir run; the trackers' contents: the ddp_run tests above)."""
    from loom.pipeline import resolve
    from loom.tracking.loggers import build_loggers

    cfg = resolve([f"tracking={choice}", "hardware=cpu", f"run.root={tmp_path}"])
    assert [type(lg).__name__ for lg in build_loggers(cfg, tmp_path, "x")] == loggers
    assert not (tmp_path / "wandb").exists()
    if choice == "mlflow":  # the default store: file:<run.root>/mlruns, absolute in the frozen config
        assert cfg.tracking.mlflow.uri == f"file:{tmp_path / 'mlruns'}"
        assert (tmp_path / "mlflow.json").is_file() and (tmp_path / "mlruns").is_dir()


@pytest.mark.parametrize(("override", "said"), [
    ("tracking.mlflow.uri=ftp://host/x", "tracking.mlflow.uri='ftp://host/x': is not an MLflow tracking URI"),
    ("tracking.mlflow.uri=http://me:hunter22@host:5000", "MLFLOW_TRACKING_PASSWORD"),
])
def test_a_bad_mlflow_uri_is_refused_naming_the_key(tmp_path, override, said):
    err = refused(tmp_path, "tracking=mlflow", override, "hardware=cpu")
    assert said in err and "tracking.mlflow.uri" in err
    assert "hunter22" not in err  # credentials are not echoed


@pytest.mark.parametrize(("args", "package", "option"), [
    (["tracking=tensorboard"], "tensorboard", "tracking=tensorboard"),
    (["tracking=mlflow"], "mlflow-skinny", "tracking=mlflow"),
    (["tracking=csv", "tracking.mlflow.enabled=true"], "mlflow-skinny", "tracking.mlflow.enabled=true"),
])
def test_a_tracker_not_installed_is_refused(tmp_path, monkeypatch, args, package, option):
    """The tracker's package missing: exit 2 at validation naming the package, the extra that
    brings it and tracking=csv instead (loom.packages; the package itself is installed here)."""
    import loom.packages

    missing = {"tensorboard", "mlflow"}
    real = loom.packages.installed
    monkeypatch.setattr(loom.packages, "installed", lambda m: m not in missing and real(m))
    err = refused(tmp_path, *args, "hardware=cpu")
    assert f"{option}" in err and f"Python package {package}" in err
    assert "loom[tracking]" in err and "tracking=csv" in err


# ----------------------------------------------------------------------------- secrets


def test_secret_keys():
    from loom.redaction import is_secret_key

    for name in ("WANDB_API_KEY", "hf_token", "HF_TOKEN", "api_key", "token", "password", "DB_PASSWORD",
                 "client_secret", "SECRET_KEY", "tracking.api_key", "passwordFile"):
        assert is_secret_key(name), name
    for name in ("flops_per_token", "tokens", "max_tokens", "seq_len", "tokenizer", "project", "name", 3):
        assert not is_secret_key(name), name


def test_redact_is_a_deep_copy_without_secrets():
    from loom.redaction import REDACTED, redact

    env = {"MY_SERVICE_TOKEN": "s3cr3t-value-123", "SHORT_TOKEN": "abc", "HOME": "/root"}
    cfg = {"tracking": {"api_key": "k-123", "project": "loom"},
           "run": {"id": "s3cr3t-value-123", "root": "/root"},
           "extra": ["--opt=s3cr3t-value-123", {"password": None, "token": 7}],
           "n": 3, "flops_per_token": 6.0}
    out = redact(cfg, env)
    assert out["tracking"] == {"api_key": REDACTED, "project": "loom"}
    assert out["run"] == {"id": REDACTED, "root": "/root"}
    assert out["extra"] == [f"--opt={REDACTED}", {"password": None, "token": REDACTED}]
    assert out["n"] == 3 and out["flops_per_token"] == 6.0
    assert cfg["tracking"]["api_key"] == "k-123"  # the input is untouched
    assert redact({"x": "abc"}, env) == {"x": "abc"}  # values under 8 characters are not matched


def test_object_storage_credentials_never_reach_what_a_run_writes():
    """The providers' credential variables are secret by name (their values scrubbed anywhere), and an
    endpoint URL carrying a password keeps its host but not the password (issue 54)."""
    from loom.redaction import REDACTED, is_secret_key, redact

    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY",
                 "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN", "dataset.storage.secret_key"):
        assert is_secret_key(name), name
    for name in ("dataset.storage.endpoint_url", "dataset.storage.profile", "dataset.cache.max_gb", "n_tokens"):
        assert not is_secret_key(name), name
    env = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEJr//////"}
    cfg = {"dataset": {"storage": {"endpoint_url": "https://loom:pa55word-1@minio.lan:9000", "profile": "train"},
                       "mix": [{"path": "s3://corpora/tok/web"}]},
           "argv": ["--key=wJalrXUtnFEMI/K7MDENG", "FwoGZXIvYXdzEJr//////"]}
    out = redact(cfg, env)
    assert out["dataset"]["storage"] == {"endpoint_url": f"https://loom:{REDACTED}@minio.lan:9000", "profile": "train"}
    assert out["dataset"]["mix"] == [{"path": "s3://corpora/tok/web"}]
    assert out["argv"] == [f"--key={REDACTED}", REDACTED]


# ----------------------------------------------------------------------------- plots and reports


def test_worker_writes_plots_at_the_end_of_a_run(ddp_run):
    # `loom report` on this shared run (another file's test may come first) adds its ranks.png; the run
    # evaluates tinycode_mc in the loop (DDP_ARGS), so the worker draws its scores too (eval.png)
    assert set(ddp_run.plots_after_train) - {"ranks.png"} == {"loss.png", "throughput.png", "utilization.png",
                                                              "eval.png"}


def test_write_plots_makes_valid_pngs(ddp_run, tmp_path):
    from loom.tracking.plots import write_plots

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ddp_run.run_dir / "metrics.csv", run / "metrics.csv")
    paths = write_plots(run)
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "utilization.png"]
    for p in paths:
        _assert_png(p)
    assert write_plots(tmp_path / "no-metrics") == []


def test_report_for_one_run(ddp_run):
    r = run_loom("report", str(ddp_run.run_dir), root=ddp_run.root)
    assert r.rc == 0, r.out + r.err
    md = (ddp_run.run_dir / "report.md").read_text()
    assert f"report: {ddp_run.run_dir / 'report.md'}" in r.out
    s = ddp_run.result.summary()
    assert f"| tokens/s | {s['throughput']['tokens_per_sec']:,.0f} |" in md
    assert "| MFU | n/a (device peak unknown) |" in md
    for name in ("loss", "throughput", "utilization"):
        assert f"![{name}](plots/{name}.png)" in md
        _assert_png(ddp_run.run_dir / "plots" / f"{name}.png")


def test_report_for_a_sweep_dir(ddp_run, single_run, tmp_path):
    sweep = tmp_path / "gpt"  # both runs side by side, as a sweep's trials are
    for run in (ddp_run.run_dir, single_run.run_dir):
        shutil.copytree(run, sweep / run.name, symlinks=True)
    r = run_loom("report", str(sweep), root=tmp_path)
    assert r.rc == 0, r.out + r.err
    md = (sweep / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 3, md  # header + one row per run
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table[1:]}
    ddp, single = ddp_run.result.summary(), single_run.summary()
    d, s1 = rows[ddp_run.run_dir.name], rows[single_run.run_dir.name]
    assert d[2:5] == ["ddp", "cpu", "2"] and s1[2:5] == ["single", "cpu", "1"]
    per_dev = ddp["throughput"]["tokens_per_sec"] / 2
    assert d[6] == f"{per_dev:,.0f}"
    assert d[7] == f"{per_dev / single['throughput']['tokens_per_sec']:.2f}" and s1[7] == "1.00"
    assert d[8] == "n/a" and d[9].endswith("GB RSS")
    assert "![scaling](scaling.png)" in md
    _assert_png(sweep / "scaling.png")
    assert "runs" in r.out and ddp_run.run_dir.name in r.out  # the rich table was printed


def test_report_of_loose_runs_goes_to_out(ddp_run, single_run, tmp_path):
    out = tmp_path / "cmp"
    r = run_loom("report", str(single_run.run_dir), str(ddp_run.run_dir), "--out", str(out), root=tmp_path)
    assert r.rc == 0, r.out + r.err
    assert (out / "report.md").is_file()
    _assert_png(out / "scaling.png")


def test_report_of_a_path_that_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        r = run_loom("report", str(path), root=tmp_path)
        assert r.rc == 2, r.out + r.err
        assert str(path) in r.err and "Traceback" not in r.err


# ----------------------------------------------------------------------------- NVML identifiers


def test_nvml_pci_bus_id_is_the_string_nvml_expects():
    from loom.hardware.nvml import pci_bus_id

    # torch gives the numbers (pci_domain_id, pci_bus_id, pci_device_id); NVML wants a string
    assert pci_bus_id(0, 0x1B, 0) == "00000000:1B:00.0"
    assert pci_bus_id(1, 0xC3, 0x1F, 2) == "00000001:C3:1F.2"


def test_nvml_targets_map_through_cuda_visible_devices():
    from loom.hardware.nvml import nvml_targets, visible_count, visible_entry

    uuid = "8932f937-d72c-4106-c12f-20bd9faed9f6"
    assert nvml_targets(0, None, uuid, (0, 0x1B, 0)) == [
        ("uuid", f"GPU-{uuid}"), ("pci", "00000000:1B:00.0"), ("index", 0)]
    # integer entries: torch index 1 is physical (NVML) device 5
    assert visible_entry(1, "3,5") == ("index", 5)
    assert nvml_targets(1, "3,5") == [("index", 5)]
    # UUID entries, with or without the GPU- prefix; MIG devices keep theirs
    assert visible_entry(0, f"GPU-{uuid},0") == ("uuid", f"GPU-{uuid}")
    assert visible_entry(1, f"0, {uuid}") == ("uuid", f"GPU-{uuid}")
    assert visible_entry(0, "MIG-abc") == ("uuid", "MIG-abc")
    # CUDA stops at an invalid entry; an index past the list has no mapping
    assert visible_entry(1, "2,-1,3") is None
    assert visible_entry(2, "0,1") is None
    assert nvml_targets(0, "", None) == []
    assert visible_count(None, 8) == 8 and visible_count("3,5", 8) == 2 and visible_count("0,-1,2", 8) == 1
    assert visible_count("", 8) == 0 and visible_count("0,1,2", 2) == 2


def test_nvml_failure_degrades_to_no_gpu_utilization(caplog):
    """nvmlInit really fails on this GPU-less machine: one warning, zeros, no crash."""
    import pynvml
    import torch

    from loom.tracking.system import GpuStats

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine: the failure path needs a host without it")
    except pynvml.NVMLError:
        pass
    with caplog.at_level("WARNING", logger="loom"):
        stats = GpuStats(cuda=True)  # as on a CUDA host whose NVML is broken
    assert not stats.available
    assert [r.levelname for r in caplog.records if "NVML" in r.getMessage()] == ["WARNING"]
    assert stats.sample(torch.device("cuda", 0)) == {"util": 0.0, "mem_gb": 0.0, "power_w": 0.0}
    assert GpuStats().available is False  # no CUDA: NVML is not even tried


def test_mfu_over_one_is_an_error_naming_the_peak(caplog):
    peak = 1e12  # a log window at 61x the claimed 1 TFLOP/s: the profile's peak is wrong
    rec = _recorder(peak)
    with caplog.at_level("ERROR", logger="loom"):
        row: dict[str, float] = {}
        rec._mfu(row, 61.44)
        rec._mfu(row, 70.0)  # the next log step: no second error line
        out = rec.rates(10 * 32, 2.0, peak)  # overall 0.06, window > 1
    assert "perf/mfu" not in row
    assert out["mfu"] is None  # flagged, not a number
    assert "MFU 61.44 > 1" in out["mfu_error"] and "peak 1.0 TFLOP/s" in out["mfu_error"]
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    row = {}
    _recorder(1e12)._mfu(row, 0.06)
    assert row["perf/mfu"] == 0.06
    assert _recorder(1e12).rates(10 * 32, 2.0, 1e12)["mfu_error"] is None


def test_each_tracking_option_turns_on_the_trackers_its_registry_entries_name():
    """A missing package's refusal says how the user turned the tracker on (`tracking=wandb`, or
    `tracking.tensorboard=true (tracking=csv)`) from the tracker registry's `options`: they must
    be the options whose yaml turns it on."""
    from loom.compose import group_options
    from loom.pipeline import resolve
    from loom.tracking.registry import TRACKERS, enabled_trackers

    for option in group_options("tracking"):
        if option == "wandb":
            continue  # online: refused here without a key; its yaml is offline's with mode: online
        on = set(enabled_trackers(resolve([f"tracking={option}"]).tracking))
        assert on == {name for name, t in TRACKERS.items() if option in t.options}, option
