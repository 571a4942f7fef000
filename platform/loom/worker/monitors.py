"""The callbacks a run trains with, one entry each: when the config turns it on and how it is built
(as the trackers' table, `loom.tracking.registry`). `worker.fit` hands the Trainer what
`callbacks` returns, in the table's order.

Order matters where two callbacks act on the same hook, and Lightning calls them in list order:
- the data position before the checkpoint saver: a checkpoint saved at a step's end holds the
  batches counted up to that step (`DataPosition.on_train_batch_end` first);
- the recorder before the saver: the step's time is measured before a save starts, and a save
  is not training time (`recorder.checkpointing`);
- the evaluation after the recorder, the saver and the train timeout: it scores the step the
  recorder has timed, a save due at the same step is written first (`recorder.apart`: neither
  is training time), and the gloo group its other ranks wait on, made at the first evaluation,
  keeps its long timeout (the train timeout shortens every group that exists after step 1);
- the user's callbacks after Loom's, so their hooks see Loom's done (`trainer.callbacks`);
- the final results last: `on_train_end` gathers weights and figures after every other
  callback's end (the recorder's last window, the garbage collector given back).

Adding a monitor: its callback module, an entry here (`on` reads the typed config; `build` may
import torch and Lightning: it runs in the worker only)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from loom.worker.failure import Progress

if TYPE_CHECKING:
    from loom.tracking.recorder import Recorder
    from loom.worker.checkpoint_saver import Checkpointing
    from loom.worker.results import RunResults

log = logging.getLogger("loom")


@dataclass(frozen=True)
class Wiring:
    """What the monitors are built from beside the config: this rank's run and the objects fit built."""

    cfg: DictConfig
    run_dir: Path
    rank: int
    progress: Progress
    saver: Checkpointing
    recorder: Recorder
    run: RunResults | None


@dataclass(frozen=True)
class Monitor:
    on: Callable[[DictConfig], bool]      # on the typed, frozen config
    build: Callable[[Wiring], list[Any]]  # its callbacks on this rank (none: it attaches elsewhere)


def _always(cfg: DictConfig) -> bool:
    return True


def _data_position(w: Wiring) -> list[Any]:
    from loom.data.position import DataPosition

    return [DataPosition()]


def _stragglers(w: Wiring) -> list[Any]:
    """Rank 0: the rule, on the vector the recorder gathers anyway (no callback of its own)."""
    if w.rank == 0:
        from loom.tracking.stragglers import StragglerWatch

        tr = w.cfg.tracking
        w.recorder.stragglers = StragglerWatch(w.run_dir, float(tr.straggler_threshold), int(tr.straggler_window))
    return []


def _garbage_collection(w: Wiring) -> list[Any]:
    from loom.worker.gc_control import GarbageCollection

    return [GarbageCollection(w.cfg.trainer.gc_every_n_steps)]


def _train_timeout(w: Wiring) -> list[Any]:
    from loom.worker.gc_control import TrainTimeout

    return [TrainTimeout(w.cfg.hardware.timeout_train_s)]


def _profile_on(cfg: DictConfig) -> bool:
    from loom.worker.profiling import profile_window

    return profile_window(cfg) is not None


def _profiling(w: Wiring) -> list[Any]:
    """trainer.profile: the profiler callback over its window of steps."""
    from loom.worker.profiling import Profiling, profile_window

    return [Profiling(w.cfg, w.run_dir, w.rank, profile_window(w.cfg))]


def hang_timeout(cfg: DictConfig) -> float:
    """hardware.hang_timeout_s (null: 80% of the collective timeout; 0: off)."""
    timeout = cfg.hardware.hang_timeout_s
    return 0.8 * float(cfg.hardware.timeout_train_s) if timeout is None else float(timeout)


def _watchdog(w: Wiring) -> list[Any]:
    from loom.worker.hang import HangWatchdog

    saver, progress = w.saver, w.progress  # a save being written, or an evaluation (rank 0's, awaited): busy
    return [HangWatchdog(w.run_dir, w.rank, hang_timeout(w.cfg), w.progress,
                         busy=lambda: saver.writing or progress.phase == "evaluating")]


def _evaluation_on(cfg: DictConfig) -> bool:
    """eval.tasks set (an older config without the eval group: off)."""
    return bool((cfg.get("eval") or {}).get("tasks"))


def _evaluation(w: Wiring) -> list[Any]:
    """eval.tasks: lm-eval's tasks on the model in memory at its steps (loom.worker.evaluation);
    rank 0's results go to summary.json through `run`."""
    from loom.worker.evaluation import Evaluation

    cb = Evaluation(w.cfg, w.run_dir, w.rank, w.progress, w.recorder, w.saver)
    if w.run is not None:
        w.run.evaluation = cb
    return [cb]


def _user_callbacks(w: Wiring) -> list[Any]:
    """trainer.callbacks: the user's own."""
    from loom.models.custom import instantiate

    return [instantiate(node) for node in w.cfg.trainer.callbacks]


MONITORS: dict[str, Monitor] = {
    "data_position": Monitor(_always, _data_position),
    "recorder": Monitor(_always, lambda w: [w.recorder]),
    "stragglers": Monitor(lambda cfg: bool(cfg.tracking.stragglers), _stragglers),
    "checkpoints": Monitor(_always, lambda w: [w.saver]),
    "garbage_collection": Monitor(lambda cfg: cfg.trainer.gc_every_n_steps > 0, _garbage_collection),
    "train_timeout": Monitor(_always, _train_timeout),
    "evaluation": Monitor(_evaluation_on, _evaluation),
    "phase": Monitor(_always, lambda w: [_phase_callback(w.progress)]),
    "profiler": Monitor(_profile_on, _profiling),
    "hang_watchdog": Monitor(lambda cfg: hang_timeout(cfg) > 0, _watchdog),
    "user": Monitor(lambda cfg: bool(cfg.trainer.callbacks), _user_callbacks),
    "results": Monitor(_always, lambda w: [_results_callback(w.run, w.saver, w.progress)]),
}


def enabled_monitors(cfg: DictConfig) -> list[str]:
    """The monitors `cfg` turns on, in the table's order."""
    return [name for name, m in MONITORS.items() if m.on(cfg)]


def callbacks(w: Wiring) -> list[Any]:
    """The Trainer's callbacks: every monitor `w.cfg` turns on, in the table's order."""
    return [cb for name in enabled_monitors(w.cfg) for cb in MONITORS[name].build(w)]


def _phase_callback(progress: Progress):
    """A callback marking the start of the training loop in `progress`."""
    import pytorch_lightning as pl

    class TrainingStarted(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            progress.phase = "training"
            if log.isEnabledFor(logging.DEBUG):  # hydra.verbose
                log_placement(trainer, pl_module)

    return TrainingStarted()


def _results_callback(run: RunResults | None, saver: Checkpointing, progress: Progress):
    """Final weights and memory figures at `on_train_end`, the last hook before Lightning's
    teardown moves the module and its optimizer state to the CPU: gathered after it, DeepSpeed's
    all-reduce of a ZeRO-2/3 bf16 parameter ran on a CPU tensor over NCCL and failed, and the
    GPU peaks were dropped as "not on CUDA" (the first H100 run). Not on a preempted stop."""
    import pytorch_lightning as pl

    class FinalResults(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            if not saver.preempted and run is not None:
                progress.phase = "writing the results"
                run.collect(trainer, pl_module)

    return FinalResults()


def log_placement(trainer, module) -> None:
    """DEBUG lines: the device mesh, and each module's parameters as the strategy placed them
    (a DTensor's placements on its mesh, else whole on its device; ZeRO-3's flat partitions)."""
    mesh = getattr(trainer.strategy, "device_mesh", None)
    log.debug(f"strategy {type(trainer.strategy).__name__}, mesh: {mesh if mesh is not None else 'none'}")
    for name, sub in module.named_modules():
        params = list(sub.named_parameters(recurse=False))
        if not params:
            continue
        parts = []
        for pname, p in params:
            placements = getattr(p, "placements", None)
            if placements is not None:
                where = f"{tuple(p.shape)} as {tuple(map(str, placements))} on mesh {tuple(p.device_mesh.mesh_dim_names or ())}"
            elif hasattr(p, "ds_shape"):
                where = f"{tuple(p.ds_shape)} as ZeRO-3 partition {tuple(p.shape)}"
            else:
                where = f"{tuple(p.shape)} whole on {p.device}"
            parts.append(f"{pname} {where}")
        log.debug(f"module {name or '(root)'}: {'; '.join(parts)}")
