"""Benchmark evaluation (conf/eval/: `eval.tasks=[...]`), scored by lm-evaluation-harness.

The package top is torch-free: the schema, the range checks, and the task checks of `checks.py`
(names resolved with lm-eval's TaskManager, data on local disk, the model able to take the
tasks), which run only when `eval.tasks` is non-empty: a run without evaluation never imports
lm_eval. `engine.py` scores a network (imported by the worker and `loom eval`); `tasks/` holds
the shipped local tasks (tinycode_mc, tinycode_complete, tinycode_ppl)."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.errors import require
from loom.eval.schema import SCHEMAS, EvalConfig, eval_length, model_context
from loom.layout import ParallelLayout
from loom.packages import Need

__all__ = ["NEEDS", "SCHEMAS", "EvalConfig", "check", "eval_length", "model_context", "normalize"]

NEEDS: tuple[Need, ...] = (
    Need("eval.tasks=[...] (non-empty)", lambda cfg: bool(cfg.eval.tasks), "lm_eval",
         example=("eval.tasks=[tinycode_mc]",)),
)


def normalize(cfg: DictConfig) -> None:
    """Nothing to fill: eval.max_length=null stays null (the engine's callers take the model's)."""


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    ev = cfg.eval
    require(ev.every_n_steps >= 0, "eval.every_n_steps", ev.every_n_steps, "must be >= 0 (0: only at the end)")
    require(ev.batch_size >= 1, "eval.batch_size", ev.batch_size, "must be a positive integer")
    require(ev.limit is None or ev.limit >= 1, "eval.limit", ev.limit,
            "must be a positive number of documents per task, or null for all")
    require(ev.num_fewshot is None or ev.num_fewshot >= 0, "eval.num_fewshot", ev.num_fewshot,
            "must be >= 0, or null for each task's own")
    if ev.max_length is not None:
        context = model_context(cfg)
        require(1 <= ev.max_length <= context, "eval.max_length", ev.max_length,
                f"must be between 1 and the model's context of {context} tokens (null: dataset.seq_len)")
    if ev.tasks:
        from loom.eval.checks import check_tasks

        check_tasks(cfg)
