"""The per-rank entry point: `python -m loom.worker <run_dir>`.

torchrun starts one per rank (a 1-process run calls `run` in-process). A worker reads the
frozen config.yaml and never re-runs Hydra, so every rank, and every restart, trains the
same run in the same directory.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from omegaconf import DictConfig

from loom.config import load_frozen

log = logging.getLogger("loom")

# Lightning advice that does not apply to Loom's setup (it chooses workers per profile and
# its own sampler on purpose).
_QUIET = (
    r".*does not have many workers.*",
    r".*The number of training batches.*",
    r".*`use_distributed_sampler`.*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*Experiment logs directory .* exists.*",
    r".*on_epoch=True.*",
    r".*your dataloader is not resumable.*",  # loom.data.position resumes it
    r".*It is recommended to use `self.log\(.*sync_dist=True`.*",
)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to logs/rank-N.log; only rank 0 also talks to the console."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"rank-{rank}.log"
    if rank != 0:
        # Quiet on other ranks: their stdout/stderr (C-level too) go to their log file.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s")
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    for name in ("loom", "pytorch_lightning", "lightning", "lightning_fabric", "deepspeed", "DeepSpeed"):
        lg = logging.getLogger(name)
        lg.handlers = [h for h in lg.handlers if not isinstance(h, logging.FileHandler)]
        lg.addHandler(file_handler)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(console)
    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(file_handler)


def quiet_library_consoles() -> None:
    """Lightning adds its own console handler when imported; its banners go to the rank log."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning"):
        lg = logging.getLogger(name)
        lg.handlers = [h for h in lg.handlers if isinstance(h, logging.FileHandler)]
        lg.propagate = False


def die_with_parent() -> None:
    """Under torchrun: get SIGTERM (-> checkpoint and stop) if the agent dies, instead of
    training on as an orphan (torchrun starts workers in their own sessions)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the agent died before we got here
        os.kill(os.getpid(), signal.SIGTERM)


def run(run_dir: Path) -> int:
    """Train the frozen run in `run_dir` on this rank; returns the process exit code."""
    die_with_parent()
    run_dir = Path(run_dir).resolve()
    cfg = load_frozen(run_dir / "config.yaml")
    rank = int(os.environ.get("RANK", 0))
    setup_logging(run_dir, rank)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # The user's OMP_NUM_THREADS wins (the launcher sets cores // processes when it is unset).
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, cores // local_world))
    os.environ["OMP_NUM_THREADS"] = str(threads)

    import torch

    torch.set_num_threads(threads)
    try:
        from loom.distributed import init_from_torchrun, shutdown

        init_from_torchrun(cfg.hardware.backend)
        rc = _fit(cfg, run_dir, rank)
        shutdown()
        return rc
    except Exception:
        log.exception(f"rank {rank} failed")
        raise


def _fit(cfg: DictConfig, run_dir: Path, rank: int) -> int:
    import pytorch_lightning as pl
    import torch

    quiet_library_consoles()
    from loom import checkpoint, strategies
    from loom.checkpointing import Checkpointing
    from loom.data import build_datamodule
    from loom.data.position import DataPosition
    from loom.models import build_module
    from loom.models.spec import model_spec
    from loom.tracking.loggers import build_loggers, truncate_metrics
    from loom.tracking.recorder import Recorder
    from loom.tracking.summary import empty_summary, write_summary

    run_id = str(cfg.run.id)
    plan = json.loads((run_dir / "plan.json").read_text())
    hw = cfg.hardware
    # The world torchrun actually formed: with elastic nodes (hardware.min_nodes) it may be
    # smaller than the profile's devices x num_nodes.
    world = int(os.environ.get("WORLD_SIZE", hw.devices * hw.num_nodes))
    num_nodes = max(1, world // hw.devices)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    resume = checkpoint.newest_checkpoint(run_dir)
    resumed_step = checkpoint.step_of(resume)
    if rank == 0 and resumed_step is not None:
        truncate_metrics(run_dir, resumed_step)
        log.info(f"resuming from {resume.relative_to(run_dir)} (step {resumed_step})")

    dp_rank, dp_size = strategies.data_parallel(cfg, rank, world)
    global_batch = cfg.dataset.batch_size * cfg.trainer.accumulate_grad_batches * dp_size  # plan's, at this world
    datamodule = build_datamodule(cfg, dp_rank, dp_size)
    module = build_module(cfg)
    spec = model_spec(cfg)
    recorder = Recorder(
        log_every=cfg.trainer.log_every_n_steps,
        samples_per_step=global_batch,
        seq_len=spec.items_per_sample,  # "tokens" per sample: seq_len, or 1 for classification
        flops_per_token=spec.flops_per_token,
        peak_flops_per_device=plan.get("peak_flops_per_device"),
        world_size=world,
    )
    saver = Checkpointing(run_dir, cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last)
    callbacks: list[pl.Callback] = [DataPosition(), recorder, saver]
    accum = cfg.trainer.accumulate_grad_batches
    val_every = cfg.trainer.val_every_n_steps or cfg.trainer.max_steps
    trainer = pl.Trainer(
        accelerator=hw.accelerator,
        devices=hw.devices,
        num_nodes=num_nodes,
        strategy=strategies.build_strategy(cfg),
        precision=hw.precision,
        max_steps=cfg.trainer.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=accum,
        gradient_clip_val=cfg.trainer.gradient_clip_val or None,
        logger=build_loggers(cfg, run_dir, run_id) or False,
        callbacks=callbacks,
        enable_checkpointing=False,  # loom.checkpointing saves (atomic, preemption-aware)
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        val_check_interval=val_every * accum,
        check_val_every_n_epoch=None,
        limit_val_batches=cfg.trainer.limit_val_batches,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )

    summary = empty_summary(cfg, run_id)
    summary.update(world_size=world, num_nodes=num_nodes)
    summary["resumed_from_step"] = resumed_step
    launch_time = float(os.environ.get("LOOM_LAUNCH_TIME", time.time()))
    status = "failed"
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None,
                    weights_only=True if resume and resume.is_file() else None)
        if saver.preempted:
            # Exit 0: a non-zero exit would make torchrun restart the ranks (max_restarts), racing
            # its own shutdown. summary.json says `preempted`; the launcher exits 143 from it.
            status = "preempted"
            return 0
        status = "completed"
        state = strategies.full_model_state(trainer, module)
        if rank == 0:
            checkpoint.save_final_weights(
                state, run_dir, {"run_id": run_id, "model": cfg.model.name, "step": str(trainer.global_step)}
            )
            summary["final_weights"] = "final/model.safetensors"
        local = recorder.rank_stats(module)
        held_params, held_optim = strategies.local_state_bytes(trainer, module)
        stats = torch.tensor(
            [local["peak_rss_gb"], local["peak_gpu_mem_gb"] or 0.0, held_params, held_optim,
             recorder.attempt()["restarts"]],
            dtype=torch.float64,
        )
        per_rank = (trainer.strategy.all_gather(stats.to(module.device)).reshape(world, -1).cpu()
                    if world > 1 else stats.unsqueeze(0))
        summary["memory"] = {
            "peak_rss_gb_per_rank": [round(float(x), 4) for x in per_rank[:, 0]],
            "peak_gpu_mem_gb_per_rank": ([round(float(x), 4) for x in per_rank[:, 1]]
                                         if module.device.type == "cuda" else None),
            "param_bytes_per_rank": [int(x) for x in per_rank[:, 2]],
            "optim_state_bytes_per_rank": [int(x) for x in per_rank[:, 3]],
        }
        # A node restarted because another failed keeps its own count: the run's is the max.
        summary["restarts"] = int(per_rank[:, 4].max())
    finally:
        if rank == 0:
            step = trainer.global_step
            attempt = recorder.attempt()
            summary.update(
                status=status,
                global_step=step,
                samples=step * global_batch,
                tokens=step * global_batch * spec.items_per_sample,
                wall_time_s=round(time.time() - launch_time, 3),
                train_time_s=round(recorder.loop_time, 3),
                final_loss=recorder.final_loss,
                first_loss=recorder.first_loss,
                restarts=max(summary["restarts"], attempt["restarts"]),
                throughput=recorder.throughput_summary(trainer, plan.get("peak_flops_per_device")),
                utilization={"cpu_percent_mean": attempt["cpu_percent_mean"],
                             "gpu_util_mean": attempt["gpu_util_mean"]},
            )
            write_summary(run_dir, summary)
            try:
                from loom.tracking.plots import write_plots

                write_plots(run_dir)
            except Exception as e:  # plots are a convenience: never fail (or mask a failure of) a run
                log.warning(f"plots not written: {type(e).__name__}: {e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m loom.worker <run_dir>", file=sys.stderr)
        return 2
    return run(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
