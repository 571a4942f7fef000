"""The run's results at the end of a rank's training: final weights and summary.json (rank 0
writes them; every rank takes part in the collectives that gather them)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from omegaconf import DictConfig

from loom.layout import ParallelLayout
from loom.models.lora_checks import lora_on
from loom.models.spec import ModelSpec
from loom.plan import Plan
from loom.rundir import checkpoints
from loom.rundir.paths import RunDir
from loom.rundir.safetensors_stream import EXPORT_DTYPES, dtype_name
from loom.rundir.summary import empty_summary, read_summary, write_summary
from loom.tracking import compiles
from loom.tracking.sources import data_field, validation_field

log = logging.getLogger("loom")


# summary.json `storage`: what the ranks read from object storage (loom.data.store.remote.stats)
STORAGE_FIELDS = ("bytes_fetched", "requests", "hits", "misses", "evictions", "retries", "uncached", "wait_s")


class RunResults:
    """summary.json of this attempt, filled as training ends; `write` runs in a `finally`, so
    a failed or preempted run gets its summary too."""

    def __init__(self, cfg: DictConfig, layout: ParallelLayout, run_dir: Path, rank: int,
                 recorder, plan: Plan, spec: ModelSpec) -> None:
        self.cfg, self.layout, self.run_dir, self.rank = cfg, layout, run_dir, rank
        self.recorder, self.plan, self.spec = recorder, plan, spec
        self.status = "failed"
        self.collected = False  # final weights and memory figures taken (`collect`)
        self.evaluation = None  # eval.tasks: the loop's Evaluation callback (loom.worker.evaluation)
        self.summary = empty_summary(cfg, str(cfg.run.id), layout)
        self.previous = read_summary(run_dir) or {}  # an earlier attempt's, when this one resumes
        recorder.data_watch.carry(self.previous.get("data_wait"))  # the data wait warning is said once per run
        self.launch_time = float(os.environ.get("LOOM_LAUNCH_TIME", time.time()))

    def collect(self, trainer, module) -> None:
        """Final weights (a collective under sharding) and every rank's memory figures, taken
        while the module is still on the device it trained on (loom.worker.fit's on_train_end)."""
        self.collected = True
        trainer.strategy.wait_for_checkpoint()  # a background checkpoint write finishes first
        self.summary["final_weights"] = self._export_final_weights(trainer, module)
        per_rank = self._gather_rank_stats(trainer)
        on_cuda = trainer.strategy.root_device.type == "cuda"
        own = getattr(module, "summary_fields", None)  # a family's own figures (a mixture of experts' load)
        if own is not None:
            self.summary.update(own())
        converter = getattr(module, "model_converter", None)  # float8: what was converted, what kept
        if converter is not None:
            self.summary.update(converter.summary_fields())
        pairs = getattr(module, "pair_step", None)  # a preference objective's figures
        if pairs is not None:
            self.summary["objective"] = pairs.summary()
        self.summary["memory"] = {
            "peak_rss_gb_per_rank": [round(float(x), 4) for x in per_rank[:, 0]],
            "build_peak_rss_gb_per_rank": [round(float(x), 4) for x in per_rank[:, 5]],
            "peak_gpu_mem_gb_per_rank": [round(float(x), 4) for x in per_rank[:, 1]] if on_cuda else None,
            "peak_gpu_reserved_gb_per_rank": [round(float(x), 4) for x in per_rank[:, 6]] if on_cuda else None,
            "param_bytes_per_rank": [int(x) for x in per_rank[:, 2]],
            "optim_state_bytes_per_rank": [int(x) for x in per_rank[:, 3]],
        }
        storage = per_rank[:, 7:7 + len(STORAGE_FIELDS)]
        if bool((storage[:, 0] >= 0).any()):  # summed over ranks, each counting its loader workers' reads
            total = storage.clamp(min=0).sum(0).tolist()
            self.summary["storage"] = {"scope": "this attempt, all ranks", **{
                k: (round(v, 3) if k == "wait_s" else int(v)) for k, v in zip(STORAGE_FIELDS, total, strict=True)}}
        # A node restarted because another failed keeps its own count: the run's is the max.
        self.summary["restarts"] = int(per_rank[:, 4].max())

    def _export_final_weights(self, trainer, module) -> str:
        """final/model.safetensors in `checkpoint.export_dtype` (integer tensors keep theirs),
        whatever the strategy: each entry is gathered whole (a collective under sharding, so
        every rank walks the same list), cast on rank 0 and streamed to the file, so no rank
        ever holds the consolidated model, let alone two copies of it. With
        `checkpoint.export_format=hf`, the same stream makes final/ a directory transformers
        loads (loom.rundir.hf_export). Returns what summary.json's `final_weights` names."""
        import torch

        if lora_on(self.cfg.model):  # final/ is a peft adapter directory (loom.models.lora)
            from loom.models.lora import export_adapter

            return export_adapter(RunDir(self.run_dir).final, self.cfg, trainer, module, self.rank)
        strategy, ckpt = trainer.strategy, self.cfg.checkpoint
        dtype = getattr(torch, EXPORT_DTYPES[ckpt.export_dtype])
        entries = strategy.model_state_entries(trainer, module)
        specs = [(k, strategy.full_shape(t), dtype_name(dtype if t.is_floating_point() else t.dtype))
                 for k, t in entries]
        tensors = ((k, strategy.gather_full_tensor(trainer, t)) for k, t in entries)
        hf = ckpt.export_format == "hf"
        if self.rank != 0:
            for _ in tensors:  # take part in every gather
                pass
            return f"{RunDir.final.rel}/" if hf else RunDir.final_weights.rel
        meta = {"run_id": str(self.cfg.run.id), "model": self.cfg.model.name,
                "step": str(trainer.global_step), "dtype": str(ckpt.export_dtype)}
        cast = ((k, t.to(dtype) if t.is_floating_point() else t) for k, t in tensors)
        if not hf:
            checkpoints.write_final_weights(self.run_dir, specs, cast, meta)
            return RunDir.final_weights.rel
        from loom.models import hf_export_config
        from loom.rundir.hf_export import write_hf_dir

        config = {**hf_export_config(self.cfg), "torch_dtype": dtype_name(dtype)}
        write_hf_dir(RunDir(self.run_dir).final, config, specs, cast, meta, float(ckpt.export_shard_gb) * 1e9,
                     self.cfg.dataset.get("tokenizer"))
        return f"{RunDir.final.rel}/"

    def _earlier(self, key: str):
        """A resumed run's value from the attempts before this one (None for a fresh run)."""
        return self.previous.get(key) if self.summary.get("resumed_from_step") is not None else None

    def _first_loss(self) -> float | None:
        """The run's first logged loss: on resume, the earlier attempts' (summary.json, else the
        first train/loss row of metrics.csv, which a resume keeps), not this attempt's."""
        if self.summary.get("resumed_from_step") is None:
            return self.recorder.first_loss
        earlier = self._earlier("first_loss")
        if earlier is None:
            from loom.tracking.plots import read_metrics

            earlier = next((r["train/loss"] for r in read_metrics(self.run_dir) if "train/loss" in r), None)
        return earlier if earlier is not None else self.recorder.first_loss

    def _gather_rank_stats(self, trainer):
        import torch

        module = trainer.lightning_module
        local = self.recorder.rank_stats(trainer.strategy.root_device)
        held_params, held_optim = trainer.strategy.local_state_bytes(trainer, module)
        stats = torch.tensor(
            [local["peak_rss_gb"], local["peak_gpu_mem_gb"] or 0.0, held_params, held_optim,
             self.recorder.attempt()["restarts"], getattr(module, "build_peak_rss_gb", None) or 0.0,
             local["peak_gpu_reserved_gb"] or 0.0, *self._storage_counts()],
            dtype=torch.float64,
        )
        world = self.layout.world
        if world == 1:
            return stats.unsqueeze(0)
        return trainer.strategy.all_gather(stats.to(trainer.strategy.root_device)).reshape(world, -1).cpu()

    def _storage_counts(self) -> list[float]:
        """This rank's object-storage counters (STORAGE_FIELDS; -1s without a remote store)."""
        get = self.recorder.data_watch.storage.stats
        stats = get() if get is not None else None
        return [float(stats[k]) for k in STORAGE_FIELDS] if stats else [-1.0] * len(STORAGE_FIELDS)

    def record_span(self, span: dict) -> None:
        """Rank 0, at every log step: this attempt's span so far into world_history.json, so
        the run's totals keep it even if this process is killed before `write`."""
        from loom.rundir.world_history import update_attempt

        update_attempt(self.run_dir, {**span, "status": "running", "launch_time": self.launch_time})

    def write(self, trainer) -> None:
        """Rank 0: summary.json (whatever the status) and the plots. Steps trained, samples,
        tokens, times and rates are the whole run's: every attempt's span added up."""
        if self.rank != 0:
            return
        from loom.rundir.world_history import TIME_PARTS, read_history, run_totals, update_attempt

        step, rec = trainer.global_step, self.recorder
        attempt = rec.attempt()
        if rec.clock.loop_start:
            update_attempt(self.run_dir, {**rec.span(step), "status": self.status, "launch_time": self.launch_time})
        history = read_history(self.run_dir)
        total = run_totals(history)
        wall_s = total["wall_s"] or round(time.time() - self.launch_time, 3)  # no span: this launch's
        self.summary.update(
            status=self.status,
            global_step=step,
            steps_trained=total["steps"],
            samples=total["samples"],
            tokens=total["tokens"],
            wall_time_s=wall_s,
            train_time_s=round(total["train_s"], 3),
            time={**{k: total[k] for k in TIME_PARTS}, "wall_s": wall_s},
            final_loss=rec.final_loss,
            first_loss=self._first_loss(),
            validation=validation_field(rec.validation) or self._earlier("validation"),
            restarts=max(self.summary["restarts"], attempt["restarts"]),
            throughput=self._throughput(total),
            utilization={"cpu_percent_mean": attempt["cpu_percent_mean"], "gpu_util_mean": attempt["gpu_util_mean"]},
            attempts=history,
            world_history=history,
            stragglers=self._stragglers(),
            recompiles=compiles.summary_field(history),
            data_wait=rec.data_watch.summary(),
        )
        if self.evaluation is not None:
            self.summary["eval"] = self._eval_field()
        data = data_field(trainer) or self._earlier("data")  # a mixture's samples and tokens per source
        if data is not None:
            self.summary["data"] = data
        self._sampled_memory()
        write_summary(self.run_dir, self.summary)
        from loom.tracking.loggers import log_summary

        log_summary(trainer.loggers, self.summary)  # MLflow keeps the outcome with the run
        from loom.packages import installed

        if not installed("matplotlib"):
            log.info("plots skipped: matplotlib is not installed (pip install 'loom[tracking]')")
            return
        try:
            from loom.tracking.plots import write_plots

            write_plots(self.run_dir)
        except Exception as e:  # plots are a convenience: never fail (or mask a failure of) a run
            log.warning(f"plots not written: {type(e).__name__}: {e}")

    def _eval_field(self) -> list[dict]:
        """summary.json `eval`: every evaluation in step order, a RESULT or {"step", "error"}; a
        resumed run keeps the earlier attempts' up to the step it resumed from."""
        start = self.summary.get("resumed_from_step")
        earlier = [e for e in (self._earlier("eval") or []) if start is not None and int(e["step"]) <= int(start)]
        return sorted([*earlier, *self.evaluation.results], key=lambda e: int(e["step"]))

    def _stragglers(self) -> list[dict]:
        """Ranks named stragglers (loom.tracking.stragglers): earlier attempts' and this one's."""
        watch = self.recorder.stragglers
        return [*(self.previous.get("stragglers") or []), *(watch.found if watch is not None else [])]

    def _throughput(self, total: dict) -> dict:
        """Steady-state rates (the steady windows of every attempt; the whole run's when no
        window was steady, e.g. a run shorter than its first log window), and beside them
        `overall`: every trained sample over all training time, compile and warm-up included."""
        peak, rec = self.plan.peak_flops_per_device, self.recorder
        overall = rec.rates(total["samples"], total["train_s"], peak)
        steady = rec.rates(total["steady_samples"], total["steady_train_s"], peak) if total["steady_samples"] else None
        trained = total.get("trained_tokens")  # padding and masked prompts left out (loom.tracking.trained)
        return {**(steady or overall), "steady": steady is not None, "steady_from_step": rec.clock.steady_step,
                "trained_tokens_per_sec": trained / total["train_s"] if trained and total["train_s"] else None,
                "overall": {k: overall[k] for k in ("samples_per_sec", "tokens_per_sec", "tflops_per_device", "mfu")}}

    def _sampled_memory(self) -> None:
        """A preempted or failed run's memory: each rank's RSS as sampled at its log steps
        (rank 0's own peak exactly); a completed run has the exact peaks (`collect`)."""
        mem = self.summary["memory"]
        if mem["peak_rss_gb_per_rank"] is not None or not self.recorder.peak_rss_per_rank:
            return
        import resource

        per_rank = list(self.recorder.peak_rss_per_rank)
        per_rank[0] = max(per_rank[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        mem["peak_rss_gb_per_rank"] = [round(x, 4) for x in per_rank]
