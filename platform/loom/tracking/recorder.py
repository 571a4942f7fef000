"""Per-step measurement: time, throughput, FLOPs/MFU, memory and utilization.

Hand-written rather than Lightning's ThroughputMonitor callback, which synchronizes the GPU
after every batch on rank 0. Here the hot path only reads a clock and adds a detached loss
tensor; the device is synchronized, metrics reduced across ranks (mean/min/max) and logged
once per `trainer.log_every_n_steps`, by rank 0. Rates and MFU come from Lightning's
`Throughput` utility over the window of logged steps. An MFU above 1 means the profile's peak
is wrong (not the run): it is not logged as perf/mfu; rank 0 logs one ERROR line naming the
peak, and summary.json has `throughput.mfu: null` with the reason in `throughput.mfu_error`.

Training time (`train_s`, the denominator of every rate) is the wall time of the training
loop, from `on_train_start` to `on_train_end`, minus the time spent in validation (as
Lightning's ThroughputMonitor also does), in checkpoint saves and in evaluation (`loom.tracking.clock`):
tokens/s counts the tokens trained per second of training. The steady rates leave out the
first logged window (or `tracking.warmup_steps`) and every window in which any rank compiled
(torch's compile hooks: loom.tracking.compiles); a recompile after the first window is one
WARNING line naming its step and the guard that failed. Rank 0 writes the attempt's span into
world_history.json at every log step (the run's totals add up every attempt's) and logs "training
loop started at step N" and "training loop ended" lines, so the rank log's timestamps are an
independent stopwatch. A window's data wait (batch end to the next batch's start, less checkpoint saves)
as a share of its step time: loom.tracking.data_wait. float8: perf/mfu_bf16_peak beside perf/mfu (trained.rates).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

import psutil
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.throughput import Throughput

from loom.hardware.peaks import mfu_error
from loom.tracking import compiles, trained
from loom.tracking.clock import Clock
from loom.tracking.data_wait import DataWaitWatch, loader_workers, window_pct
from loom.tracking.stragglers import gather_hosts
from loom.tracking.system import GpuStats

log = logging.getLogger("loom")

# Order of the per-rank vector all-gathered at every log step.
_FIELDS = ("step_time_ms", "data_wait_ms", "cpu_percent", "rss_gb", "gpu_util", "gpu_mem_gb",
           "gpu_power_w", "loss", "step1_loss", "compute_ms", "compile_s", "trained_tokens", "storage_wait_ms")


class Recorder(pl.Callback):
    def __init__(
        self,
        *,
        log_every: int,
        samples_per_step: int,          # global: micro batch x accumulation x data-parallel size
        seq_len: int,
        flops_per_token: float | None,
        peak_flops_per_device: float | None,
        world_size: int,
        token_data: bool = True,        # False: a classifier, whose rate is samples/s (no tokens)
        warmup_steps: int | None = None,  # tracking.warmup_steps (None: the first logged window)
        on_log=None,                    # rank 0, at every log step: on_log(span) (world_history)
        model_parallel: int = 1,        # ranks that see the same batch (tp x pp x cp): trained tokens count once
        bf16_peak_flops: float | None = None, peak_precision: str | None = None,  # the plan's (float8)
    ) -> None:
        self.log_every = log_every
        self.token_data = token_data
        self.samples_per_step = samples_per_step
        self.seq_len = seq_len
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_flops, self.bf16_peak, self.peak_precision = peak_flops_per_device, bf16_peak_flops, peak_precision
        self.mfu_error: str | None = None  # the first impossible MFU (> 1): the peak is wrong
        self.throughput = Throughput(available_flops=peak_flops_per_device, world_size=world_size, window_size=2)
        self.proc = psutil.Process()
        self.gpu = GpuStats()
        # State of this attempt (the run's totals add up every attempt's span: world_history).
        self.start_step = 0
        self.clock = Clock(warmup_steps=warmup_steps)
        self.compiles = compiles.CompileWatch()
        self.checkpointing = None       # the saver (its `seconds`: time in checkpoint saves)
        self.on_log = on_log
        self.loop_time = 0.0            # training time so far (clock.train_s at the last log step)
        self.val_window = 0.0           # validation and evaluation time in the current logging window
        self.window_compile_s = 0.0     # the slowest rank's compile seconds in the last log window
        self.ckpt_at_log = 0.0
        self.val_start: float | None = None
        self.step1_loss: torch.Tensor | None = None
        self.peak_rss_per_rank: list[float] | None = None  # rank 0: max over log steps (a failed run's memory)
        self.last_log_time = 0.0
        self.last_log_step = 0
        self.batch_end = self.ckpt_at_batch_end = 0.0  # and the saver's seconds then (a save is no data wait)
        self.data_wait = 0.0
        self.data_watch = DataWaitWatch()  # rank 0: perf/data_wait_pct's maximum and its one warning
        self.compute = 0.0              # this rank's own forward time in the window (stragglers)
        self.forward_start: float | None = None
        self.stragglers = None          # rank 0: a loom.tracking.stragglers.StragglerWatch
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self.first_loss = self.final_loss = None  # float | None each: step 1's and the last window's
        self.validation: dict[str, float] | None = None  # the last validation's val/* metrics
        self.history: list[dict[str, float]] = []   # rank 0: the logged rows
        self.trained = trained.TrainedTokens()      # this rank's trained targets in the window
        self.model_parallel = model_parallel
        self.trained_total: float | None = None     # rank 0: the attempt's trained targets (None: no labels)
        self.cpu_samples, self.gpu_util_samples = [], []  # list[float] each: the logged rows' sys/ figures

    # ---------------------------------------------------------------- hot path
    def _ckpt_seconds(self) -> float:
        return float(getattr(self.checkpointing, "seconds", 0.0))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = self.last_log_step = trainer.global_step
        self.proc.cpu_percent(None)
        self._sync(pl_module)
        self.clock.start(self.start_step, self._ckpt_seconds())
        self.compiles.start()
        self.ckpt_at_log = self.clock.checkpoint_s
        self.last_log_time = self.batch_end = self.clock.loop_start
        self.ckpt_at_batch_end = self._ckpt_seconds()
        self.data_watch.start(loader_workers(trainer))
        self.throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0 if self.flops_per_token else None)
        if trainer.global_rank == 0:  # before the collective below: the line's time is the clock's start
            log.info(f"training loop started at step {self.start_step}")
        hosts = gather_hosts(trainer.world_size)  # once, for naming a straggler's host
        if self.stragglers is not None:
            self.stragglers.hosts = hosts

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.forward_start = time.perf_counter()
        self.data_wait += self.forward_start - self.batch_end - (self._ckpt_seconds() - self.ckpt_at_batch_end)
        self.compiles.step, self.compiles.phase = trainer.global_step + 1, "train"

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        """The end of this rank's forward: its own work before the gradients' collectives."""
        if self.forward_start is not None:
            self.compute += time.perf_counter() - self.forward_start
            self.forward_start = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach()
            if pl_module.automatic_optimization:  # Lightning hands back loss / accumulation
                loss = loss * trainer.accumulate_grad_batches
            self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
            self.loss_count += 1
            if trainer.global_step == 1 and self.step1_loss is None:  # a fresh run's first loss
                self.step1_loss = self.loss_sum / self.loss_count
        self.trained.add(batch)
        step = trainer.global_step
        self.clock.step_done(step, self._ckpt_seconds())
        if step > self.last_log_step and (step % self.log_every == 0 or step >= trainer.max_steps):
            self._log(trainer, pl_module)
        self.batch_end, self.ckpt_at_batch_end = time.perf_counter(), self._ckpt_seconds()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.compiles.phase = "validation"
        if trainer.sanity_checking or not self.clock.loop_start:
            return
        self._sync(pl_module)
        self.val_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Validation runs after the optimizer step it follows, but Lightning would log it at the
        step before (its logger step is incremented after validation): log it at global_step."""
        if not trainer.sanity_checking:
            pl_module.log("step", float(trainer.global_step), logger=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = {k[len("val/"):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics and not trainer.sanity_checking:
            self.validation = {**metrics, "step": trainer.global_step}
        if self.val_start is None:
            return
        self._sync(pl_module)
        self.clock.validation_s += self.apart(time.perf_counter() - self.val_start)
        self.val_start = None

    def apart(self, seconds: float) -> float:
        """Seconds after a step not training (validation, evaluation): out of its window and data wait."""
        self.val_window += seconds
        self.batch_end, self.ckpt_at_batch_end = time.perf_counter(), self._ckpt_seconds()
        return seconds

    # ---------------------------------------------------------------- log steps
    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(pl_module)
        now = time.perf_counter()
        step = trainer.global_step
        steps = step - self.last_log_step
        ckpt = self.clock.checkpoint_s - self.ckpt_at_log
        window = now - self.last_log_time - self.val_window - ckpt
        gpu = self.gpu.sample(pl_module.device)
        loss = (self.loss_sum / max(1, self.loss_count)).float() if self.loss_sum is not None else None
        compiled = compiles.training_compiles(self.compiles.drain())
        local = torch.tensor(
            [
                1000 * window / steps,
                1000 * self.data_wait / steps,
                self.proc.cpu_percent(None),
                self.proc.memory_info().rss / 2**30,
                gpu["util"],
                gpu["mem_gb"],
                gpu["power_w"],
                loss.item() if loss is not None else float("nan"),
                self.step1_loss.float().item() if self.step1_loss is not None else float("nan"),
                1000 * self.compute / steps,
                sum(e.seconds for e in compiled),
                self.trained.take(),
                1000 * self.data_watch.storage.take() / steps,
            ],
            dtype=torch.float64,
        )
        gathered = self._gather(trainer, local, pl_module.device)
        self.loss_sum, self.loss_count, self.data_wait, self.val_window, self.compute = None, 0, 0.0, 0.0, 0.0
        self.step1_loss = None
        self._clock_window(trainer, gathered, step, now, compiled)
        self.last_log_step, self.last_log_time, self.ckpt_at_log = step, now, self.clock.checkpoint_s
        self.loop_time = self.clock.train_s(now)

        per_device_samples = (step - self.start_step) * self.samples_per_step // self.world_size
        per_device_tokens = per_device_samples * self.seq_len
        flops = None
        if self.flops_per_token:
            flops = int(steps * self.samples_per_step * self.seq_len * self.flops_per_token / self.world_size)
        self.throughput.update(
            time=self.loop_time, batches=step - self.start_step, samples=per_device_samples,
            lengths=per_device_tokens, flops=flops,
        )
        rates = self.throughput.compute()
        if trainer.global_rank != 0:
            return
        self._keep_peaks(gathered)
        counts = gathered[:, _FIELDS.index("trained_tokens")]  # each rank's; a model-parallel group's are one
        trained_window = None if bool(counts.isnan().any()) else float(counts.sum()) / self.model_parallel
        if trained_window is not None:
            self.trained_total = (self.trained_total or 0.0) + trained_window
        if self.stragglers is not None:
            col = {name: i for i, name in enumerate(_FIELDS)}
            self.stragglers.update(step, *(gathered[:, col[k]].tolist() for k in ("step_time_ms", "data_wait_ms",
                                                                                 "compute_ms")))
        if self.on_log is not None:
            self.on_log(self.span(step))
        row = self._row(trainer, gathered, rates)
        if trained_window is not None and window > 0:
            row["perf/trained_tokens_per_sec"] = trained_window / window
        self._publish(trainer, step, row)
        self.data_watch.window_row(step - steps, step, row)  # after the step line it is about

    def _clock_window(self, trainer: pl.Trainer, gathered: torch.Tensor, step: int, now: float,
                      compiled: list[compiles.CompileEvent]) -> None:
        """The window's compiles into the clock: one on any rank leaves the window out of the
        steady rates (the others wait for it in the next collective). Rank 0 warns of one
        after the attempt's first window, the step line shows the longest rank's seconds."""
        per_rank = gathered[:, _FIELDS.index("compile_s")].tolist()
        ranks = [r for r, seconds in enumerate(per_rank) if seconds > 0]
        found = compiles.recompiles(compiled, self.start_step + 1)
        begins, self.window_compile_s = self.last_log_step, max(per_rank)
        self.clock.log_step(step, now, sum(e.seconds for e in compiled), compiled=bool(ranks), recompiles=found)
        if ranks and begins > self.start_step and trainer.global_rank == 0:
            log.warning(compiles.warning(begins, step, found, ranks))

    def _keep_peaks(self, gathered: torch.Tensor) -> None:
        """Rank 0: every rank's RSS at this log step, kept as a running max; and the first
        loss, step 1's (mean over ranks), when this window held step 1."""
        col = {name: i for i, name in enumerate(_FIELDS)}
        rss = [float(x) for x in gathered[:, col["rss_gb"]]]
        prev = self.peak_rss_per_rank or rss
        self.peak_rss_per_rank = [max(a, b) for a, b in zip(prev, rss, strict=False)] if len(prev) == len(rss) else rss
        step1 = gathered[:, col["step1_loss"]]
        if self.first_loss is None and not bool(step1.isnan().any()):
            self.first_loss = float(step1.mean())

    def span(self, step: int) -> dict[str, Any]:
        """This attempt's span so far (world_history.json), with its trained targets where counted."""
        span = self.clock.span(step, self.samples_per_step, self.seq_len)
        return {**span, "trained_tokens": None if self.trained_total is None else int(self.trained_total)}

    def _row(self, trainer: pl.Trainer, gathered: torch.Tensor, rates: dict[str, float]) -> dict[str, float]:
        """The metrics of one log step (metric names: docs/tracking.md) from every rank's vector."""
        mean = gathered.mean(0)
        col = {name: i for i, name in enumerate(_FIELDS)}
        row: dict[str, float] = {
            "train/loss": float(mean[col["loss"]]),
            "train/lr": float(trainer.optimizers[0].param_groups[0]["lr"]) if trainer.optimizers else float("nan"),
            "perf/step_time_ms": float(mean[col["step_time_ms"]]),
            "perf/step_time_ms_min": float(gathered[:, col["step_time_ms"]].min()),
            "perf/step_time_ms_max": float(gathered[:, col["step_time_ms"]].max()),
            "perf/data_wait_ms": float(mean[col["data_wait_ms"]]),
            "perf/data_wait_pct": window_pct(float(mean[col["data_wait_ms"]]), float(mean[col["step_time_ms"]])),
            "perf/storage_wait_ms": float(mean[col["storage_wait_ms"]]),
            "perf/samples_per_sec": rates.get("device/samples_per_sec", 0.0) * self.world_size,
            "perf/tokens_per_sec": rates.get("device/items_per_sec", 0.0) * self.world_size,
            "sys/cpu_percent": float(mean[col["cpu_percent"]]),
            "sys/rss_gb": float(mean[col["rss_gb"]]),
            "sys/rss_gb_max": float(gathered[:, col["rss_gb"]].max()),
            "sys/world_size": float(self.world_size),  # changes when a run resumes at another world
        }
        if not self.token_data:  # a classifier: its items are samples, there are no tokens
            del row["perf/tokens_per_sec"]
        if "device/flops_per_sec" in rates:
            row["perf/tflops_per_device"] = rates["device/flops_per_sec"] / 1e12
        if "device/mfu" in rates:
            self._mfu(row, rates["device/mfu"])
        if self.gpu.available:
            row["sys/gpu_util"] = float(mean[col["gpu_util"]])
            row["sys/gpu_mem_gb"] = float(mean[col["gpu_mem_gb"]])
            row["sys/gpu_power_w"] = float(mean[col["gpu_power_w"]])
        return row

    def _mfu(self, row: dict[str, float], value: float) -> None:
        """perf/mfu (float8: and perf/mfu_bf16_peak), unless > 1 (the profile's peak is wrong): then no value,
        and the error is logged once (rank 0) and kept for summary.json `throughput.mfu_error`."""
        err = mfu_error(value, self.peak_flops)
        if err is None:
            row["perf/mfu"] = value
            row |= {"perf/mfu_bf16_peak": value * self.peak_flops / self.bf16_peak} if self.bf16_peak else {}
        elif self.mfu_error is None:
            self.mfu_error = err
            log.error(err)

    def _publish(self, trainer: pl.Trainer, step: int, row: dict[str, float]) -> None:
        """Rank 0: keep the row, send it to the loggers, print the progress line."""
        if "sys/gpu_util" in row:
            self.gpu_util_samples.append(row["sys/gpu_util"])
        self.cpu_samples.append(row["sys/cpu_percent"])
        if self.first_loss is None:
            self.first_loss = row["train/loss"]
        self.final_loss = row["train/loss"]
        self.history.append({"step": step, **row})
        for logger in trainer.loggers:
            logger.log_metrics(row, step=step)
        eta_s = max(0, trainer.max_steps - step) * row["perf/step_time_ms"] / 1000
        rate = (f"{row['perf/tokens_per_sec']:,.0f} tok/s" if self.token_data
                else f"{row['perf/samples_per_sec']:,.1f} samples/s")
        log.info(
            f"step {step}/{trainer.max_steps}  loss {row['train/loss']:.4f}  "
            f"{rate}  {row['perf/step_time_ms']:.1f} ms/step  "
            f"ETA {int(eta_s // 60)}:{int(eta_s % 60):02d}"
            + (f"  (compiling: {self.window_compile_s:.1f} s)" if self.window_compile_s > 0 else ""),
        )

    def _gather(self, trainer: pl.Trainer, local: torch.Tensor, device: torch.device) -> torch.Tensor:
        if trainer.world_size == 1:
            return local.unsqueeze(0)
        gathered = trainer.strategy.all_gather(local.to(device))
        return gathered.reshape(trainer.world_size, -1).cpu()

    # ---------------------------------------------------------------- end of run
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > self.last_log_step:
            self._log(trainer, pl_module)
        self._sync(pl_module)
        self.clock.step_done(trainer.global_step, self._ckpt_seconds())
        self.clock.stop()
        self.compiles.stop()
        self.loop_time = self.clock.train_s()
        if trainer.global_rank == 0:
            log.info(f"training loop ended at step {trainer.global_step}: {self.loop_time:.3f} s training, "
                     f"{self.clock.validation_s:.3f} s validation, {self.clock.checkpoint_s:.3f} s checkpoints")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.compiles.stop()

    def rank_stats(self, device: torch.device) -> dict[str, float]:
        """This rank's peaks, for summary.json (gathered by the worker). GPU memory twice:
        allocated (what tensors held: what the plan estimates and the benchmarks report) and
        reserved (the caching allocator's blocks: what the device had to have free). `device`
        is the strategy's (the module's own is the CPU once Lightning has torn down)."""
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        peak_gpu = reserved = None
        if device.type == "cuda":
            peak_gpu = torch.cuda.max_memory_allocated(device) / 2**30
            reserved = torch.cuda.max_memory_reserved(device) / 2**30
        return {"peak_rss_gb": peak_rss, "peak_gpu_mem_gb": peak_gpu, "peak_gpu_reserved_gb": reserved}

    def rates(self, samples: int, seconds: float, peak_flops: float | None) -> dict[str, Any]:
        """loom.tracking.trained.rates of this run; an impossible MFU's error logged once."""
        out = trained.rates(samples, seconds, peak_flops, items_per_sample=self.seq_len, token_data=self.token_data,
                            flops_per_token=self.flops_per_token, world_size=self.world_size,
                            bf16_peak_flops=self.bf16_peak, peak_precision=self.peak_precision)
        if out["mfu_error"] and self.mfu_error is None:
            log.error(out["mfu_error"])
        out["mfu_error"] = out["mfu_error"] or self.mfu_error
        out["mfu"] = None if out["mfu_error"] else out["mfu"]
        return out

    def attempt(self) -> dict[str, Any]:
        return {
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "cpu_percent_mean": sum(self.cpu_samples) / len(self.cpu_samples) if self.cpu_samples else None,
            "gpu_util_mean": (sum(self.gpu_util_samples) / len(self.gpu_util_samples)
                              if self.gpu_util_samples else None),
        }
