"""Reporting what the data did (issue 37): the loader's share of each log window
(`perf/data_wait_pct`), one warning for the run naming the likely cause (summary.json
`data_wait`), and a mixture's sources: per-source validation losses (`val/loss/<name>` ->
summary.json `validation.per_source`), each source's samples and tokens (the datamodule's
`source_report()` -> summary.json `data`), both in report.md's "Data sources" table.

All in-process, no launch: the recorder driven as Lightning drives it with timed sleeps, the
summary written by the worker's own RunResults from fabricated recorder state, report.md
rendered from a fabricated run dir, and one in-process Lightning Trainer over a tiny model
with two validation sources and a slow loader."""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loom.tracking.data_wait import IN_PROCESS, STORAGE, WORKERS, DataWaitWatch

ADVICE_IN_PROCESS = ("with hardware.dataloader_workers=0 the batches are read and collated in the training "
                     "process; raise hardware.dataloader_workers")


def _warning(pct: float, first: int, step: int, advice: str) -> str:
    return (f"Data wait: the training loop waited {pct:.1f}% of steps {first}-{step} for its batches (over 5%): "
            f"{advice} (summary.json data_wait, metrics perf/data_wait_pct)")


def _recorder(world: int = 1, log_every: int = 2):
    from loom.tracking.recorder import Recorder

    return Recorder(log_every=log_every, samples_per_step=4, seq_len=8, flops_per_token=None,
                    peak_flops_per_device=None, world_size=world)


def _stub_trainer(max_steps: int, workers: int | None = 0) -> SimpleNamespace:
    """What the Recorder reads of Lightning's Trainer; `train_dataloader` as the loop runs it."""
    loader = SimpleNamespace(num_workers=workers) if workers is not None else None
    return SimpleNamespace(global_step=0, world_size=1, global_rank=0, max_steps=max_steps, optimizers=[],
                           loggers=[], accumulate_grad_batches=1, sanity_checking=False, callback_metrics={},
                           train_dataloader=loader)


# ----------------------------------------------------------------------------- the percentage


def test_data_wait_pct_is_the_rows_mean_wait_over_its_mean_step_time():
    """Two ranks: step times 100 and 120 ms, waits 4 and 18 ms -> means 110 and 11 -> 10%
    (the ratio of the row's own two means, so metrics.csv's three columns agree)."""
    from loom.tracking.recorder import _FIELDS

    rec = _recorder(world=2)
    gathered = torch.zeros(2, len(_FIELDS), dtype=torch.float64)
    gathered[:, _FIELDS.index("step_time_ms")] = torch.tensor([100.0, 120.0])
    gathered[:, _FIELDS.index("data_wait_ms")] = torch.tensor([4.0, 18.0])
    row = rec._row(_stub_trainer(10), gathered, {})
    assert row["perf/data_wait_ms"] == pytest.approx(11.0)
    assert row["perf/data_wait_pct"] == pytest.approx(10.0)
    gathered[:, _FIELDS.index("step_time_ms")] = 0.0  # a window without time: 0, not a division error
    assert rec._row(_stub_trainer(10), gathered, {})["perf/data_wait_pct"] == 0.0


class _Clock:
    """perf_counter for loom.tracking's recorder and clock: time moves only when the test says, so
    the figures are exact on a machine of any load (issue 49: real sleeps read 20% off under load)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch) -> _Clock:
    from loom.tracking import clock, recorder

    c = _Clock()
    for module in (clock, recorder):
        monkeypatch.setattr(module, "time", c)
    return c


def test_the_recorder_warns_once_past_5_percent_leaving_out_the_first_window_and_checkpoint_saves(caplog, fake_clock):
    """The Recorder driven as Lightning drives it, 8 steps of 20 ms compute, log windows of 2:
    (0,2] waits 30 ms per batch (the loader's start-up: left out), (2,4] waits nothing but holds
    a 60 ms checkpoint save between steps 3 and 4 (the saver's time: no data wait), (4,6] waits
    10 ms per batch (1/3) and (6,8] 15 ms (3/7). One warning, at step 6, naming in-process loading."""
    rec, trainer = _recorder(), _stub_trainer(8, workers=0)
    module = SimpleNamespace(device=torch.device("cpu"), automatic_optimization=True)
    saver = SimpleNamespace(seconds=0.0)
    rec.checkpointing = saver
    rec.on_train_start(trainer, module)
    with caplog.at_level(logging.INFO, logger="loom"):
        for step in range(1, 9):
            fake_clock.sleep(0.03 if step <= 2 else 0.0 if step <= 4 else 0.01 if step <= 6 else 0.015)  # the loader
            rec.on_train_batch_start(trainer, module, None, step - 1)
            fake_clock.sleep(0.02)  # forward, backward, optimizer
            trainer.global_step = step
            rec.on_train_batch_end(trainer, module, torch.tensor(1.0), None, step - 1)
            if step == 3:  # the saver after the recorder in on_train_batch_end, as in loom.worker.fit
                fake_clock.sleep(0.06)
                saver.seconds += 0.06
        rec.on_train_end(trainer, module)
    rows = {int(r["step"]): r for r in rec.history}
    expected = {2: (50, 30), 4: (20, 0), 6: (30, 10), 8: (35, 15)}  # ms per step: step time, data wait
    assert {s: (r["perf/step_time_ms"], r["perf/data_wait_ms"]) for s, r in rows.items()} == {
        s: (pytest.approx(t), pytest.approx(w, abs=1e-9)) for s, (t, w) in expected.items()}
    pct = {s: r["perf/data_wait_pct"] for s, r in rows.items()}
    assert pct == {s: pytest.approx(100 * w / t, abs=1e-9) for s, (t, w) in expected.items()}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [_warning(pct[6], 5, 6, ADVICE_IN_PROCESS)]
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("step ", "Data wait"))]
    assert steps.index(warnings[0]) == steps.index(next(s for s in steps if s.startswith("step 6/8"))) + 1
    assert rec.data_watch.summary() == {"max_window_pct": round(100 * 15 / 35, 2), "max_window_step": 8,
                                        "warned_at_step": 6, "cause": IN_PROCESS, "threshold_pct": 5.0}
    # each step's own seconds after the first (the save left out), for a sweep's noise (loom.report.tie)
    times = [0.05, 0.02, 0.02, 0.03, 0.03, 0.035, 0.035]
    assert list(rec.clock.step_times) == pytest.approx(times)
    diffs = [b - a for a, b in zip(times, times[1:], strict=False)]
    import statistics

    assert rec.clock.step_stats() == {"timed_steps": 7, "step_s_mean": pytest.approx(sum(times) / 7, abs=1e-6),
                                      "step_s_noise": pytest.approx(statistics.stdev(diffs) / 2 ** 0.5, abs=1e-6)}


def test_a_loader_waiting_on_object_storage_is_named_as_the_cause(caplog):
    """perf/storage_wait_ms (the readers' blocked fetch time) at half the data wait or more names
    object storage and what to raise; under half, the loader's workers stay the likely cause."""
    watch = DataWaitWatch()
    watch.start(2)
    with caplog.at_level(logging.WARNING, logger="loom"):
        watch.window(0, 10, 90.0, storage_ms=400.0, data_ms=450.0)  # start-up: left out
        watch.window(10, 20, 30.0, storage_ms=60.0, data_ms=100.0)
    assert watch.summary()["cause"] == STORAGE
    assert "waited on object storage (perf/storage_wait_ms): raise dataset.cache.prefetch" in caplog.text
    other = DataWaitWatch()
    other.start(2)
    other.window(0, 10, 0.0)
    other.window(10, 20, 30.0, storage_ms=40.0, data_ms=100.0)
    assert other.summary()["cause"] == WORKERS


def test_workers_that_cannot_keep_up_are_named_and_a_resume_does_not_warn_again(caplog):
    watch = DataWaitWatch()
    watch.start(4)
    with caplog.at_level(logging.WARNING, logger="loom"):
        watch.window(0, 10, 80.0)   # the first window: start-up, left out of the rule and the maximum
        watch.window(10, 20, 4.9)
        watch.window(20, 30, 7.5)   # warned here
        watch.window(30, 40, 12.25)  # a larger window later: the maximum, no second warning
    advice = ("the loader (its 4 workers) cannot keep up: more hardware.dataloader_workers, faster storage, "
              "or prepare the data with `loom data prepare`")
    assert [r.getMessage() for r in caplog.records] == [_warning(7.5, 21, 30, advice)]
    earlier = watch.summary()
    assert earlier == {"max_window_pct": 12.25, "max_window_step": 40, "warned_at_step": 30, "cause": WORKERS,
                       "threshold_pct": 5.0}
    caplog.clear()
    resumed = DataWaitWatch()
    resumed.carry(json.loads(json.dumps(earlier)))  # as RunResults reads it back from summary.json
    resumed.start(4)
    with caplog.at_level(logging.WARNING, logger="loom"):
        resumed.window(40, 50, 90.0)  # the resumed attempt's first window: start-up again
        resumed.window(50, 60, 9.0)
    assert caplog.records == [] and resumed.summary() == earlier
    quiet = DataWaitWatch()
    quiet.start(None)
    quiet.window(0, 5, 50.0)
    assert quiet.summary()["max_window_pct"] is None  # no window after the first
    quiet.window(5, 10, 1.234)
    assert quiet.summary() == {"max_window_pct": 1.23, "max_window_step": 10, "warned_at_step": None,
                               "cause": None, "threshold_pct": 5.0}


# ----------------------------------------------------------------------------- summary.json


class _Mixture:
    """A datamodule that knows its mixture, with numpy counters (json cannot write those)."""

    def source_report(self):
        import numpy as np

        return {"sources": {"web": {"weight": np.float64(0.7), "samples": np.int64(700), "tokens": np.int64(89600),
                                    "epochs": np.float32(0.25)},
                            "code": {"weight": 0.3, "samples": 300, "tokens": 38400, "epochs": 1.5}}}


class _Failing:
    def source_report(self):
        raise RuntimeError("index not built")


def _results(run_dir: Path, recorder):
    from loom.pipeline import resolve
    from loom.strategies import layout_of
    from loom.worker.results import RunResults

    cfg = resolve(["hardware=cpu", "tracking=csv"])
    return RunResults(cfg, layout_of(cfg), run_dir, 0, recorder, SimpleNamespace(peak_flops_per_device=None), None)


def _written(tmp_path: Path, name: str, datamodule, validation) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    rec = _recorder()
    rec.validation = validation
    rec.data_watch.start(0)
    for begins, step, pct in ((0, 2, 60.0), (2, 4, 3.5), (4, 6, 8.0)):
        rec.data_watch.window(begins, step, pct)
    _results(run_dir, rec).write(SimpleNamespace(global_step=6, loggers=[], datamodule=datamodule))
    return json.loads((run_dir / "summary.json").read_text())


def test_summary_json_carries_per_source_validation_the_sources_and_the_data_wait(tmp_path):
    validation = {"loss": 2.5, "loss/web": 2.0, "loss/code": 3.125, "step": 6}
    s = _written(tmp_path, "mix", _Mixture(), validation)
    assert s["validation"] == {"loss": 2.5, "step": 6, "per_source": {"web": 2.0, "code": 3.125}}
    assert s["data"] == {"sources": {"web": {"weight": 0.7, "samples": 700, "tokens": 89600, "epochs": 0.25},
                                     "code": {"weight": 0.3, "samples": 300, "tokens": 38400, "epochs": 1.5}}}
    assert s["data_wait"] == {"max_window_pct": 8.0, "max_window_step": 6, "warned_at_step": 6,
                              "cause": IN_PROCESS, "threshold_pct": 5.0}


def test_other_datamodules_and_single_source_validation_are_unchanged(tmp_path, caplog):
    """No `source_report` (or None, or a failure: one warning): no `data`; one validation source:
    no `per_source`; `data_wait` is there whatever the run (the template's, in a failed summary)."""
    plain = {"loss": 1.5, "acc": 0.75, "step": 6}
    with caplog.at_level(logging.WARNING, logger="loom"):
        for name, dm in (("none", None), ("plain", SimpleNamespace()),
                         ("silent", SimpleNamespace(source_report=lambda: None)), ("failing", _Failing())):
            s = _written(tmp_path, name, dm, dict(plain))
            assert "data" not in s and s["validation"] == plain, name
            assert s["data_wait"]["warned_at_step"] == 6
    assert [r.getMessage() for r in caplog.records if "source_report" in r.getMessage()] == [
        "summary.json data not recorded: source_report() failed (RuntimeError: index not built)"]
    from loom.pipeline import resolve
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = resolve(["hardware=cpu"])
    assert empty_summary(cfg, "r", layout_of(cfg))["data_wait"] == {
        "max_window_pct": None, "max_window_step": None, "warned_at_step": None, "cause": None, "threshold_pct": 5.0}


# ----------------------------------------------------------------------------- report.md


def _fabricated_run(run_dir: Path) -> dict:
    from loom.pipeline import resolve
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    cfg = resolve(["hardware=cpu"])
    run_dir.mkdir(parents=True)
    s = empty_summary(cfg, "mix", layout_of(cfg))
    s.update(status="completed", global_step=4, final_loss=2.1,
             validation={"loss": 2.45, "step": 4, "per_source": {"web": 2.25, "code": 2.875}},
             data={"sources": {"web": {"weight": 0.7, "samples": 1400, "tokens": 179200, "epochs": 0.5},
                               "code": {"weight": 0.3, "samples": 600, "tokens": 76800, "epochs": 2.0}}},
             data_wait={"max_window_pct": 12.5, "max_window_step": 4, "warned_at_step": 4, "cause": IN_PROCESS,
                        "threshold_pct": 5.0})
    (run_dir / "summary.json").write_text(json.dumps(s))
    rows = ["step,train/loss,perf/data_wait_ms,perf/data_wait_pct,perf/step_time_ms,val/loss,val/loss/code,val/loss/web",
            "2,2.5,1.0,2.0,50.0,,,", "4,2.1,6.25,12.5,50.0,,,", "4,,,,,2.45,2.875,2.25"]
    (run_dir / "metrics.csv").write_text("\n".join(rows) + "\n")
    return s


def test_report_md_shows_the_sources_table_and_the_data_wait(tmp_path):
    from loom.report.runs import load_run, run_report

    run_dir = tmp_path / "mix"
    _fabricated_run(run_dir)
    md = run_report(load_run(run_dir)).read_text()
    assert ("| data wait | 12.5% of step time at most (the log window ending at step 4); over 5% at step 4 "
            "(likely cause: hardware.dataloader_workers=0) |") in md
    assert "| validation | loss 2.4500 at step 4 |" in md
    table = ["## Data sources", "",
             "Per source: samples and tokens trained from each source and validation loss at step 4.", "",
             "| source | weight | samples | tokens | epochs | val loss |", "|---|---|---|---|---|---|",
             "| web | 0.700 | 1,400 | 179,200 | 0.500 | 2.2500 |",
             "| code | 0.300 | 600 | 76,800 | 2.000 | 2.8750 |", ""]
    assert "\n".join(table) in md, md
    assert md.index("| data wait |") < md.index("## Data sources") < md.index("## Plots")


def test_the_sources_table_with_only_one_side_and_without_either():
    from loom.report.sources import data_wait_text, sources_section

    only_val = sources_section({"validation": {"loss": 2.0, "step": 8, "per_source": {"a": 1.5, "b": 2.5}}})
    assert only_val == ["## Data sources", "", "Per source: validation loss at step 8.", "",
                        "| source | val loss |", "|---|---|", "| a | 1.5000 |", "| b | 2.5000 |", ""]
    only_data = sources_section({"validation": {"loss": 2.0, "step": 8},
                                 "data": {"sources": {"a": {"weight": 1.0, "samples": 8, "tokens": 1024}}}})
    assert only_data[2:] == ["Per source: samples and tokens trained from each source.", "",
                             "| source | weight | samples | tokens | epochs |", "|---|---|---|---|---|",
                             "| a | 1.000 | 8 | 1,024 | n/a |", ""]
    assert sources_section({"validation": None}) == [] and sources_section({}) == []
    assert data_wait_text({"max_window_pct": 0.5, "max_window_step": 20, "warned_at_step": None}) == (
        "0.5% of step time at most (the log window ending at step 20)")
    assert data_wait_text(None) == data_wait_text({"max_window_pct": None}) == "n/a (no log window after the first)"


def test_slash_nested_validation_names_are_read_and_plotted_apart(tmp_path):
    """metrics.csv's `val/loss/<source>` columns: read as their own series, never as `val/loss`,
    and drawn in loss.png (a PNG is written)."""
    from loom.tracking.plots import _series, per_source_keys, read_metrics, write_plots

    run_dir = tmp_path / "mix"
    _fabricated_run(run_dir)
    rows = read_metrics(run_dir)
    assert per_source_keys(rows) == ["val/loss/code", "val/loss/web"]
    assert _series(rows, "val/loss") == ([4.0], [2.45])
    assert _series(rows, "val/loss/web") == ([4.0], [2.25])
    paths = write_plots(run_dir)
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "utilization.png"]
    assert (run_dir / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- in a Trainer


class _SlowSet(torch.utils.data.Dataset):
    """A dataset whose every sample takes 25 ms to read: the loader, not the model, is slow (a
    batch of 4 sleeps 100 ms; the step's own work, a few ms idle, stays far below it under load)."""

    def __init__(self, n: int) -> None:
        self.x, self.y = torch.randn(n, 8), torch.randn(n, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(0.025)
        return self.x[i], self.y[i]


def _lightning_classes():
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.val_losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log(f"val/loss/{self.trainer.datamodule.val_names[dataloader_idx]}", loss, add_dataloader_idx=False)
            self.val_losses.append(loss.detach())

        def on_validation_epoch_end(self) -> None:
            self.log("val/loss", torch.stack(self.val_losses).mean())
            self.val_losses.clear()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Mixture(pl.LightningDataModule):
        val_names = ["web", "code"]

        def train_dataloader(self):
            return DataLoader(_SlowSet(32), batch_size=4)

        def val_dataloader(self):
            return [DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1) + shift), batch_size=4)
                    for shift in (0.0, 3.0)]

        def source_report(self):
            return {"sources": {"web": {"weight": 0.5, "samples": 16, "tokens": 16, "epochs": 0.5},
                                "code": {"weight": 0.5, "samples": 16, "tokens": 16, "epochs": 2.0}}}

    return Tiny, Mixture


def test_a_trainer_with_a_slow_loader_and_two_validation_sources(tmp_path, caplog):
    """In-process Lightning: the summary, metrics.csv and report.md of a run whose loader reads
    in the training process (workers 0) and sleeps 100 ms a batch while the step takes well under
    that, and whose module logs `val/loss/web` and `val/loss/code` beside `val/loss`."""
    import pytorch_lightning as pl

    from loom.report.runs import load_run, run_report
    from loom.rundir.world_history import record_attempt
    from loom.tracking.loggers import RunCSVLogger

    Tiny, Mixture = _lightning_classes()
    rec = _recorder(log_every=2)
    run = _results(tmp_path, rec)
    rec.on_log = run.record_span
    record_attempt(tmp_path, 0, 1, 1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=RunCSVLogger(tmp_path),
                         log_every_n_steps=2, callbacks=[rec], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         num_sanity_val_steps=0)
    with caplog.at_level(logging.WARNING, logger="loom"):
        trainer.fit(Tiny(), datamodule=Mixture())
        run.status = "completed"
        run.write(trainer)
    s = json.loads((tmp_path / "summary.json").read_text())
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    pct = {int(r["step"]): float(r["perf/data_wait_pct"]) for r in rows if r.get("perf/data_wait_pct")}
    assert sorted(pct) == [2, 4, 6, 8] and min(pct.values()) > 50, pct
    val = [r for r in rows if r.get("val/loss")]
    assert len(val) == 1 and int(val[0]["step"]) == 8
    assert s["validation"] == {"loss": pytest.approx(float(val[0]["val/loss"])), "step": 8,
                               "per_source": {"web": pytest.approx(float(val[0]["val/loss/web"])),
                                              "code": pytest.approx(float(val[0]["val/loss/code"]))}}
    assert s["validation"]["per_source"]["code"] > s["validation"]["per_source"]["web"]  # targets shifted by 3
    assert s["data"] == Mixture().source_report()
    assert s["data_wait"] == {"max_window_pct": round(max(pct[4], pct[6], pct[8]), 2),
                              "max_window_step": max((4, 6, 8), key=pct.get), "warned_at_step": 4,
                              "cause": IN_PROCESS, "threshold_pct": 5.0}
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Data wait")] == [
        _warning(pct[4], 3, 4, ADVICE_IN_PROCESS)]
    md = run_report(load_run(tmp_path)).read_text()
    assert "| web | 0.500 | 16 | 16 | 0.500 | " in md and "| code | 0.500 | 16 | 16 | 2.000 | " in md
