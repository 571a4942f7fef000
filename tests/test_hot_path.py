"""The training step is kept clean (issue 36): between log steps, nothing Loom adds to a step
opens a file or emits a log record.

In-process, no launch: a Lightning Trainer over a tiny model with the worker's per-step
callbacks as loom.worker.fit builds them (data position, recorder with the straggler rule,
checkpointing, GC control, the train timeout, the hang watchdog) and metrics.csv. A Python
audit hook sees every `open` (and rename, remove, mkdir) of the process and a handler every
log record of any logger, each tagged with where the loop was: inside a step (data fetch,
forward, backward, optimizer, the step-end hooks) or in the step-end hooks of a log step,
the one place that may write. Per-step speed is a benchmark's (scripts/bench/overhead.py)."""

from __future__ import annotations

import logging
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from loom.tracking.loggers import RunCSVLogger
from loom.tracking.recorder import Recorder
from loom.tracking.stragglers import StragglerWatch
from loom.worker.checkpoint_saver import Checkpointing
from loom.worker.failure import Progress
from loom.worker.gc_control import GarbageCollection, TrainTimeout
from loom.worker.hang import HangWatchdog

STEPS, LOG_EVERY, GC_EVERY = 12, 4, 3
WATCHED = {"open", "os.rename", "os.replace", "os.remove", "os.mkdir", "shutil.rmtree"}
_WHERE: dict[str, object] = {"phase": None, "trainer": None, "events": None}


def _audit(event: str, args: tuple) -> None:
    """Process-wide and permanent (audit hooks cannot be removed): inert outside this test."""
    events = _WHERE["events"]
    if events is not None and event in WATCHED and _WHERE["phase"] is not None:
        events.append((_WHERE["phase"], _WHERE["trainer"].global_step, event, str(args[0])[:120]))


class _Records(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if _WHERE["events"] is not None and _WHERE["phase"] is not None:
            _WHERE["events"].append((_WHERE["phase"], _WHERE["trainer"].global_step, "log", record.getMessage()[:120]))


class _Mark(pl.Callback):
    """First in the list: a step starts (`step`), its end hooks start (`end`); last in the
    list: the end hooks are over, the loop fetches the next batch (`step` again), or the loop
    is over."""

    def __init__(self, last: bool) -> None:
        self.last = last

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _WHERE["phase"] = "step"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.last:
            _WHERE["phase"] = "end"
        else:  # after the last step the loop ends (Lightning says so): no step is running
            _WHERE["phase"] = "step" if trainer.global_step < trainer.max_steps else None

    def on_train_end(self, trainer, pl_module) -> None:
        _WHERE["phase"] = None


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_between_log_steps_no_file_is_opened_and_no_line_is_logged(tmp_path):
    from loom.data.position import DataPosition

    sys.addaudithook(_audit)
    recorder = Recorder(log_every=LOG_EVERY, samples_per_step=4, seq_len=1, flops_per_token=None,
                        peak_flops_per_device=None, world_size=1, token_data=False)
    recorder.stragglers = StragglerWatch(tmp_path, 0.2, 5)
    saver = Checkpointing(tmp_path, 0, 2)
    recorder.checkpointing = saver
    callbacks = [_Mark(last=False), DataPosition(), recorder, saver, GarbageCollection(GC_EVERY), TrainTimeout(300),
                 HangWatchdog(tmp_path, 0, 300.0, Progress()), _Mark(last=True)]
    data = TensorDataset(torch.randn(4 * STEPS, 8), torch.randn(4 * STEPS, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=RunCSVLogger(tmp_path),
                         log_every_n_steps=LOG_EVERY, callbacks=callbacks, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         num_sanity_val_steps=0, limit_val_batches=0)
    handler, loom_log = _Records(level=logging.DEBUG), logging.getLogger("loom")
    level = loom_log.level
    logging.getLogger().addHandler(handler)
    loom_log.addHandler(handler)
    loom_log.setLevel(logging.DEBUG)  # a debug line formatted per step counts too
    events: list[tuple] = []
    _WHERE.update(trainer=trainer, events=events)
    try:
        trainer.fit(_Tiny(), DataLoader(data, batch_size=4))
    finally:
        _WHERE.update(events=None, phase=None)
        logging.getLogger().removeHandler(handler)
        loom_log.removeHandler(handler)
        loom_log.setLevel(level)
    log_steps = {s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS}
    allowed = [e for e in events if e[0] == "end" and e[1] in log_steps]
    assert {e[1] for e in allowed} >= {LOG_EVERY}, events  # the log steps did write (metrics, ranks.jsonl)
    assert [e for e in events if e not in allowed] == [], [e for e in events if e not in allowed]
    assert (tmp_path / "ranks.jsonl").read_text().count("\n") == len(log_steps)
    assert callbacks[4].collections == STEPS // GC_EVERY


def test_a_cpu_rank_keeps_its_heap_unless_the_user_chose(monkeypatch):
    """loom.worker.host_memory: glibc takes the settings on a CPU run (in a child process: they
    last for the process); a GPU run, a user's MALLOC_* or LD_PRELOAD allocator is left alone."""
    import subprocess

    from loom.worker.host_memory import USER_SETTINGS, keep_heap

    code = "from loom.worker.host_memory import keep_heap; print(keep_heap('cpu'), keep_heap('gpu'))"
    env = {k: v for k, v in __import__("os").environ.items() if k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["True", "False"], out
    for key in ("MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):
        monkeypatch.setenv(key, "1" if key.startswith("MALLOC") else "/usr/lib/libjemalloc.so")
        assert keep_heap("cpu") is False
        monkeypatch.delenv(key)
