"""`eval.tasks` in the training loop: the model as it is in memory, scored by lm-evaluation-harness
(`loom.eval.engine.evaluate`) every `eval.every_n_steps` optimizer steps and after the last one
(`eval.at_end`), without writing a checkpoint.

The route, under every strategy, is the cheapest correct one that needs nothing of the strategy
beyond what the final weights already use (`model_state_entries` / `gather_full_tensor`):
- single, DDP, ZeRO-1/2 (every entry held whole on rank 0, not compiled): rank 0 scores the
  training module's own network in eval mode, in place: no copy, no collective;
- FSDP2, TP, N-D, ZeRO-3, pipeline stages, and any compiled model: every entry is gathered whole
  to rank 0's CPU one tensor at a time (the collective each strategy's final-weights export
  makes: a DTensor's `full_tensor`, DeepSpeed's GatheredParameters / fp32 master, a stage's
  entries sent to rank 0), loaded into an unsharded, uncompiled copy of the network built on
  rank 0 (`module.build_model()` on meta, the LoRA adapters injected as in training), moved to
  rank 0's device and scored there; the copy is dropped afterwards. Its cost: one full copy of
  the weights on rank 0's device (and its CPU) during the evaluation.
The other ranks wait in a broadcast of the outcome on a gloo group made for it at the first
evaluation, with a timeout of `WAIT_S` (the training groups' `hardware.timeout_train_s` is far
too short for a benchmark). Requests are not split over data-parallel ranks: lm-eval's own
split (its `rank`/`world_size`) reorders and pads requests per rank and gathers the results
over its accelerator, which would need a copy per rank (the gather above gives one only to
rank 0) and lm-eval's collectives beside Lightning's; the broadcast keeps one in flight.

The seconds an evaluation takes are apart from training: the recorder leaves them out of the
step times, the steady windows, tokens/s and MFU (`Recorder.apart`), and summary.json's
time split shows them as `eval_s`. The random streams (Python, NumPy, torch CPU and CUDA) are
restored afterwards: lm-eval seeds them, training's dropout and sampling must not see it.

Rank 0 logs `eval/<task>/<metric>` to every tracker at the step, writes each RESULT to
`<run>/eval/step-NNNNNNN.json` with "source": "loop", and keeps the list for summary.json's
`eval`. An exception while building the copy or scoring is one ERROR paragraph in the rank log
naming the step and the tasks, an entry `{"step": N, "error": ...}`, and training goes on.
"""

from __future__ import annotations

import gc
import json
import logging
import random
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig

from loom.atomic import atomic_write_text
from loom.rundir.paths import RunDir
from loom.worker.failure import Progress

log = logging.getLogger("loom")

WAIT_S = 6 * 3600  # how long the other ranks wait for rank 0's evaluation


class Evaluation(pl.Callback):
    """Scores the model at its steps (module docstring). `results` (rank 0): this attempt's
    entries in step order, a RESULT or {"step", "error"}."""

    def __init__(self, cfg: DictConfig, run_dir: Path, rank: int, progress: Progress, recorder: Any,
                 saver: Any = None) -> None:
        self.cfg, self.ev, self.run_dir, self.rank = cfg, cfg.eval, Path(run_dir), rank
        self.progress, self.recorder, self.saver = progress, recorder, saver
        self.every = int(self.ev.get("every_n_steps") or 0)
        self.at_end = bool(self.ev.get("at_end", True))
        self.results: list[dict[str, Any]] = []
        self.start_step = self.last_step = 0
        self._group = None

    def due(self, step: int, max_steps: int) -> bool:
        """Whether optimizer step `step` (just done) is evaluated: once, after this attempt's start."""
        if step <= self.start_step or step == self.last_step:
            return False
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step >= max_steps)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = self.last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.due(step, trainer.max_steps) or getattr(self.saver, "preempted", False):
            return  # a preempted run (every rank agreed) has no time to spare
        self.last_step = step
        self.recorder.compiles.phase = "eval"  # a compile while scoring is not a training compile
        phase, self.progress.phase = self.progress.phase, "evaluating"  # the hang watchdog waits for it
        begin = time.perf_counter()
        try:
            entry = self.run(trainer, pl_module, step)
        finally:
            self.progress.phase = phase
        self.recorder.clock.eval_s += self.recorder.apart(time.perf_counter() - begin)
        if self.rank == 0:
            self.record(trainer, entry)

    # ------------------------------------------------------------------ one evaluation
    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> dict[str, Any]:
        """The evaluation on rank 0, every rank taking part in the gather and the wait; returns
        the entry (rank 0's, broadcast to the others)."""
        whole = held_whole(trainer, pl_module) and not self.cfg.trainer.get("compile", False)
        state = None if whole else gather_state(trainer, pl_module)
        entry: dict[str, Any] | None = None
        if self.rank == 0:
            with kept_random_state():
                entry = self.score(trainer, pl_module, step, state)
        del state
        gc.collect()
        return self.broadcast(trainer, entry)

    def score(self, trainer, pl_module, step: int, state: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Rank 0: the RESULT of `eval.tasks` at `step`, or the error entry."""
        try:
            from loom.eval import eval_length
            from loom.eval.engine import evaluate

            device = trainer.strategy.root_device
            net = getattr(pl_module, "model", pl_module) if state is None else full_copy(pl_module, state, device)
            was_training = net.training
            net.eval()
            try:
                with torch.no_grad(), trainer.strategy.precision_plugin.forward_context():
                    result = evaluate(logits_of(net), run_tokenizer(self.cfg), self.ev,
                                      max_length=eval_length(self.cfg), device=device, step=step)
            finally:
                net.train(was_training)
            return {**result, "step": step}
        except Exception as e:  # evaluation is a report on the model: it never stops training
            tasks = ", ".join(str(t) for t in self.ev.tasks)
            error = one_line(e)
            log.error(f"evaluation at step {step} failed (eval.tasks: {tasks}): {error}. Training continues; "
                      f"summary.json's eval has the error at step {step}.", exc_info=log.isEnabledFor(logging.DEBUG))
            return {"step": step, "error": error}

    def broadcast(self, trainer: pl.Trainer, entry: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's entry to every rank: the others wait here (module docstring: `WAIT_S`)."""
        import torch.distributed as dist

        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return entry or {}
        if self._group is None:  # made once, by every rank at the same step (a collective)
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=WAIT_S))
        box = [entry]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0] or {}

    def record(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        """Rank 0: the trackers, `<run>/eval/step-N.json` and the summary's list."""
        self.results.append(entry)
        if "error" in entry:
            return
        from loom.eval.engine import flat_metrics

        path = RunDir(self.run_dir).eval_result(int(entry["step"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**entry, "source": "loop"}, indent=2) + "\n")
        metrics = flat_metrics(entry)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=int(entry["step"]))
        shown = ", ".join(f"{k[len('eval/'):]} {v:.4f}" for k, v in metrics.items())
        log.info(f"eval at step {entry['step']} ({entry.get('seconds', 0.0):.1f} s): {shown}")


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`, or where it was raised when it has none (a bare assert)."""
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text.splitlines()[0]}"
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return f"{type(e).__name__} at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else type(e).__name__


# ---------------------------------------------------------------------- the route's parts
def held_whole(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Whether this rank holds every entry of the network whole (single, DDP, ZeRO-1/2): no
    DTensor shard, no ZeRO-3 partition, no other stage's (meta) entry."""
    from torch.distributed.tensor import DTensor

    strategy = trainer.strategy
    for _, t in strategy.model_state_entries(trainer, module):
        if isinstance(t, DTensor) or hasattr(t, "ds_id") or t.is_meta or tuple(t.shape) != strategy.full_shape(t):
            return False
    return True


def gather_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor] | None:
    """Every entry whole on rank 0's CPU (None elsewhere): one collective per entry, the same
    walk as the final weights' (loom.worker.results), so no rank holds two full copies."""
    strategy = trainer.strategy
    out: dict[str, torch.Tensor] = {}
    for key, t in strategy.model_state_entries(trainer, module):
        full = strategy.gather_full_tensor(trainer, t)
        if full is not None:
            out[key] = full
    return out if trainer.is_global_zero else None


def full_copy(module: pl.LightningModule, state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
    """An unsharded, uncompiled network holding `state`: built on meta (its buffers real, as
    training builds it), the run's LoRA adapters injected under training's names, then the
    gathered tensors assigned and the whole moved to `device`."""
    from loom.models.init import params_on_meta
    from loom.models.lora_checks import lora_on

    with params_on_meta():
        net = module.build_model()
        if lora_on(module.cfg.get("model")):
            from peft import inject_adapter_in_model

            from loom.models.lora import ADAPTER, peft_config

            inject_adapter_in_model(peft_config(module.cfg.model), net, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    net.load_state_dict(state, strict=True, assign=True)
    return net.to(device)


def logits_of(net: torch.nn.Module):
    """The engine's callable: (B, T) token ids -> (B, T, V) float32 logits (a transformers model's
    output carries them as `.logits`; under a mixed-precision autocast they come back in bf16,
    whose log-softmax would round the scores)."""
    def call(ids: torch.Tensor) -> torch.Tensor:
        out = net(ids)
        return getattr(out, "logits", out).float()

    return call


def run_tokenizer(cfg: DictConfig):
    """The run's tokenizer (`loom.eval.checks.text_encoding`: `dataset.tokenizer`, local files
    only), else byte-level ids (the engine's `byte_tokenizer`, as Loom's byte data), as `loom eval`."""
    from loom.eval.checks import text_encoding

    name = text_encoding(cfg)
    if name is None or name == "bytes":  # None: refused before launch (no text); bytes otherwise
        from loom.eval.engine import byte_tokenizer

        return byte_tokenizer()
    from loom.data.tokenizer import load_tokenizer

    return load_tokenizer(name)


@contextmanager
def kept_random_state():
    """Python's, NumPy's and torch's (CPU and CUDA) random states as they were before."""
    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
