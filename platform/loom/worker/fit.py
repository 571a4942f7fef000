"""Build the Trainer from the frozen config's groups and train (every rank).

Reads top to bottom as torchtitan's train.py: layout -> data -> model -> callbacks ->
strategy -> Trainer -> fit -> results.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from loom import data, models, strategies
from loom.layout import ParallelLayout, world_of
from loom.models.lora_checks import lora_on
from loom.plan import Plan
from loom.rundir import checkpoints
from loom.rundir.paths import RunDir
from loom.worker import monitors, results
from loom.worker.failure import Progress

log = logging.getLogger("loom")


def fit(cfg: DictConfig, run_dir: Path, rank: int, progress: Progress | None = None) -> int:
    """Train this rank to the end (or to a preemption); rank 0 writes the run's results.
    `progress` says how far it got, for the failure record if it raises."""
    import pytorch_lightning as pl

    quiet_library_consoles()
    from loom.float8.convert import converter as float8_converter
    from loom.tracking.recorder import Recorder
    from loom.worker.checkpoint_saver import Checkpointing

    progress = progress or Progress()
    frozen_plan = json.loads(RunDir(run_dir).plan.read_text())
    plan = Plan.from_dict(frozen_plan)
    layout = formed_layout(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    _matmul_precision(cfg.hardware)
    resume = _resume_point(run_dir, rank)
    progress.start_step = checkpoints.step_of(resume) or 0
    if rank == 0:  # this attempt in summary.json's world_history, before anything can kill it
        _record_attempt(cfg, run_dir, progress.start_step, layout)
    saver = Checkpointing(run_dir, cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last)
    with stop_signals(saver):
        progress.phase = "building the data"
        datamodule = data.build_datamodule(cfg, layout, rank)
        progress.phase = "building the model"
        module = models.build_module(cfg)
        module.pair_step = objective_step(cfg)  # a preference objective's step and reference, else None
        module.model_converter = float8_converter(cfg)  # float8 training (torchao), else None
        # a resume restores the checkpoint's weights; a LoRA checkpoint holds the adapter alone: the base is read again
        if cfg.model.get("init_from") and (resume is None or lora_on(cfg.model)):
            module.init_source = cfg.model.init_from
        if layout.pp > 1:  # the pipeline schedule runs forward and backward (strategies.pipeline)
            module.automatic_optimization = False
        spec = models.model_spec(cfg)
        recorder = Recorder(
            log_every=cfg.trainer.log_every_n_steps,
            samples_per_step=layout.global_batch(cfg.dataset.batch_size, cfg.trainer.accumulate_grad_batches),
            seq_len=spec.items_per_sample,  # "tokens" per sample: seq_len, or 1 for classification
            flops_per_token=spec.flops_per_token,
            peak_flops_per_device=plan.peak_flops_per_device,  # the matmuls' precision's (float8's under float8=)
            bf16_peak_flops=plan.peak_flops_per_device_bf16, peak_precision=plan.peak_precision,
            world_size=layout.world,
            token_data=data.is_token_data(cfg.dataset),
            warmup_steps=cfg.tracking.get("warmup_steps"),
            model_parallel=layout.batch_sharers,  # ranks sharing a batch (tp x pp x cp), each counting all of it
        )
        recorder.checkpointing = saver  # its save time is not training time
        recorder.data_watch.storage.stats = data.storage_stats  # object-storage counters, where the data is remote
        run = results.RunResults(cfg, layout, run_dir, rank, recorder, plan, spec)
        recorder.on_log = run.record_span
        progress.phase = "building the trainer"
        wiring = monitors.Wiring(cfg, run_dir, rank, progress, saver, recorder, run)
        trainer = _trainer(cfg, layout, run_dir, monitors.callbacks(wiring))  # the table's, in its order
        progress.trainer, progress.phase = trainer, "setting up training (model, strategy, checkpoint)"
        run.summary["resumed_from_step"] = checkpoints.step_of(resume)
        run.summary["init_from"] = cfg.model.get("init_from")
        run.summary["extended_from_steps"] = frozen_plan.get("extended_from_steps")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None,
                        weights_only=True if resume and resume.is_file() else None)
            if saver.preempted:
                # Exit 0: a non-zero exit would make torchrun restart the ranks (max_restarts), racing
                # its own shutdown. summary.json says `preempted`; the launcher exits 143 from it.
                run.status = "preempted"
                return 0
            if not run.collected:  # the loop had nothing to run (resumed at its last step): no on_train_end
                progress.phase = "writing the results"
                run.collect(trainer, module)
            run.status = "completed"
        finally:
            run.write(trainer)
    return 0


def objective_step(cfg: DictConfig):
    """The run's pair objective's step (loom.objectives.step, torch), or None: the loss is the model's own."""
    from loom.objectives.step import for_run

    return for_run(cfg)


def formed_layout(cfg: DictConfig) -> ParallelLayout:
    """The layout of the world torchrun actually formed (WORLD_SIZE: with hardware.min_nodes it
    may be smaller than the profile's devices x num_nodes), never the profile's alone; the
    accumulation in `cfg` is re-derived there to keep the run's trainer.global_batch_size."""
    formed = os.environ.get("WORLD_SIZE")
    layout = strategies.layout_of(cfg, world=int(formed) if formed else None)
    if cfg.trainer.get("global_batch_size"):
        from loom.strategies.world import derive_accumulation

        derive_accumulation(cfg, int(cfg.trainer.global_batch_size), world=layout.world)
    return layout


def _record_attempt(cfg: DictConfig, run_dir: Path, start_step: int, layout: ParallelLayout) -> None:
    """Append this attempt to the world history; a world torchrun re-formed with another size
    (an elastic run that lost or regained a node) is said on the console, as a launch at another
    world says it, since the launcher of a surviving node learns of the change only here."""
    from loom.rundir.world_history import record_attempt

    history = record_attempt(run_dir, start_step, layout.world, layout.num_nodes)
    profile = world_of(cfg.hardware)
    within_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or layout.world != profile
    if history[-1]["reason"] == "world change" and within_launch:  # else loom.freeze said it
        tr = cfg.trainer
        log.info(f"World change: {history[-2]['world_size']} -> {layout.world} rank(s) on {layout.num_nodes} "
                 f"node(s) from step {start_step}; trainer.accumulate_grad_batches {tr.accumulate_grad_batches} "
                 f"keeps trainer.global_batch_size={tr.get('global_batch_size')}")


@contextmanager
def stop_signals(saver) -> Iterator[None]:
    """SIGINT and SIGTERM, on every strategy and in a 1-process run alike (the launcher runs
    that one in-process), ask for a stop: the ranks save a checkpoint at the next log step (one process: the next step)
    and the run ends `preempted` (exit 143). Lightning would turn SIGINT into a failed run
    without a checkpoint. The previous handlers come back afterwards (an in-process sweep's
    next trial, the launcher itself)."""
    import signal

    previous = {sig: signal.signal(sig, saver._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def quiet_library_consoles() -> None:
    """Lightning adds its own console handler when imported; its banners go to the rank log."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning"):
        lg = logging.getLogger(name)
        lg.handlers = [h for h in lg.handlers if isinstance(h, logging.FileHandler)]
        lg.propagate = False


def _resume_point(run_dir: Path, rank: int) -> Path | None:
    """The newest complete checkpoint; rank 0 drops the metric rows past it (they are redone)."""
    from loom.tracking.loggers import truncate_metrics

    resume = checkpoints.newest_checkpoint(run_dir)
    step = checkpoints.step_of(resume)
    log.debug(f"resume point: {resume or 'none (step 0)'}; checkpoints dir {RunDir(run_dir).checkpoints}")
    if rank == 0 and step is not None:
        truncate_metrics(run_dir, step)
        log.info(f"resuming from {resume.relative_to(run_dir)} (step {step})")
    return resume


def _trainer(cfg: DictConfig, layout: ParallelLayout, run_dir: Path, callbacks: list):
    import pytorch_lightning as pl

    from loom.tracking.loggers import build_loggers

    hw, tr = cfg.hardware, cfg.trainer
    val_every = tr.val_every_n_steps or tr.max_steps
    return pl.Trainer(
        accelerator=hw.accelerator,
        devices=hw.devices,
        num_nodes=layout.num_nodes,
        strategy=strategies.build_strategy(cfg, layout),
        precision=strategies.lightning_precision(cfg),  # one mixed-precision mechanism per strategy
        max_steps=tr.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=tr.accumulate_grad_batches,
        gradient_clip_val=(tr.gradient_clip_val or None) if layout.pp == 1 else None,  # pp clips itself
        logger=build_loggers(cfg, run_dir, str(cfg.run.id)) or False,
        callbacks=callbacks,
        enable_checkpointing=False,  # loom.worker.checkpoint_saver saves (atomic, preemption-aware)
        log_every_n_steps=tr.log_every_n_steps,
        val_check_interval=val_every * tr.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=1.0 if tr.limit_val_batches else 0,  # the loaders hold the global count (LoomDataModule)
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )


def _matmul_precision(hw) -> None:
    """TF32 for fp32 matmuls and convolutions on GPUs when `hardware.tf32` (torch's default is
    full fp32, at an eighth of the Tensor Cores' rate; Lightning warns about it). Left alone on
    the CPU, where "high" would let oneDNN compute fp32 matmuls in bf16."""
    if hw.accelerator != "gpu":
        return
    import torch

    torch.set_float32_matmul_precision("high" if hw.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = bool(hw.tf32)
