"""The monitors' table (loom.worker.monitors): which callbacks a config turns on, and the Trainer's
callback list built from it, in-process on composed and validated configs (no launch)."""

from __future__ import annotations

import inspect

import pytest

from loom.compose import compose
from loom.validate import validate
from loom.worker import fit, monitors
from loom.worker.failure import Progress

BASE = ["hardware=cpu", "hardware.devices=2", "model=gpt_tiny", "trainer.max_steps=4"]
ALWAYS = ["data_position", "recorder", "checkpoints", "train_timeout", "phase", "results"]


def _cfg(*overrides: str):
    return validate(compose([*BASE, *overrides]))


@pytest.mark.parametrize("overrides, on, off", [
    ((), ["stragglers", "garbage_collection", "hang_watchdog"], ["profiler", "user", "evaluation"]),
    (("tracking=csv", "tracking.stragglers=false"), [], ["stragglers"]),
    (("trainer.gc_every_n_steps=0",), ["stragglers"], ["garbage_collection"]),
    (("hardware.hang_timeout_s=0",), [], ["hang_watchdog"]),
    (("hardware.hang_timeout_s=30",), ["hang_watchdog"], []),
    (("trainer.profile.steps=[1,2]",), ["profiler"], []),
    (("eval.tasks=[tinycode_mc]",), ["evaluation"], []),
])
def test_each_monitor_is_on_where_the_config_turns_it_on(overrides, on, off):
    enabled = monitors.enabled_monitors(_cfg(*overrides))
    assert set(ALWAYS) | set(on) <= set(enabled) and not set(off) & set(enabled), enabled
    assert enabled == [name for name in monitors.MONITORS if name in enabled]  # the table's order


def test_the_evaluation_follows_the_recorder_the_saver_and_the_train_timeout():
    """loom.worker.monitors' docstring: the step is timed and saved first, and the wait group the
    evaluation makes keeps its timeout (the train timeout shortens the groups that exist)."""
    order = list(monitors.MONITORS)
    assert max(order.index(n) for n in ("recorder", "checkpoints", "train_timeout")) < order.index("evaluation")


def test_the_straggler_rule_is_the_schemas_and_settable_from_every_tracking_option():
    from loom.compose import group_options

    for option in group_options("tracking"):
        tr = _cfg(f"tracking={option}", "tracking.straggler_window=7").tracking
        assert (tr.stragglers, tr.straggler_threshold, tr.straggler_window) == (True, 0.2, 7), option


def test_the_trainers_callbacks_are_the_tables_in_its_order(tmp_path):
    from loom.tracking.recorder import Recorder
    from loom.worker.checkpoint_saver import Checkpointing

    cfg = _cfg("trainer.profile.steps=[1,2]", "hardware.hang_timeout_s=60")
    recorder = Recorder(log_every=1, samples_per_step=8, seq_len=16, flops_per_token=None,
                        peak_flops_per_device=None, world_size=2, token_data=True, warmup_steps=None,
                        model_parallel=1)
    saver = Checkpointing(tmp_path, 10, 2)
    wiring = monitors.Wiring(cfg, tmp_path, 0, Progress(), saver, recorder, None)
    built = monitors.callbacks(wiring)
    names = [type(cb).__name__ for cb in built]
    assert names == ["DataPosition", "Recorder", "Checkpointing", "GarbageCollection", "TrainTimeout",
                     "TrainingStarted", "Profiling", "HangWatchdog", "FinalResults"]
    assert built[1] is recorder and built[2] is saver
    assert recorder.stragglers is not None  # rank 0: the straggler rule rides on the recorder
    assert built[7].timeout_s == 60.0
    assert all(cb is not recorder.stragglers for cb in built)
    rank1 = Recorder(log_every=1, samples_per_step=8, seq_len=16, flops_per_token=None, peak_flops_per_device=None,
                     world_size=2, token_data=True, warmup_steps=None, model_parallel=1)
    monitors.callbacks(monitors.Wiring(cfg, tmp_path, 1, Progress(), saver, rank1, None))
    assert rank1.stragglers is None  # rank 0 alone judges


def test_fit_takes_its_callbacks_from_the_table_alone():
    source = inspect.getsource(fit)
    assert "monitors.callbacks(" in source
    for cls in ("DataPosition(", "GarbageCollection(", "TrainTimeout(", "HangWatchdog(", "Profiling(", "StragglerWatch("):
        assert cls not in source, cls
