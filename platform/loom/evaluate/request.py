"""What `loom eval` was asked, checked torch-free: the run, its weights (export's selection), the
tasks (resolved and checked as `eval.tasks` is at validation: an unknown name lists the closest,
data not on this disk is refused, the run's text encoding and context) and lm-eval's settings:
the run's own `eval` section with the flags over it."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from loom.errors import ConfigError
from loom.eval.checks import check_tasks, text_encoding
from loom.eval.schema import EvalConfig, eval_length
from loom.export import Request
from loom.export import request as export_request
from loom.export.select import run_dir_of
from loom.models.registry import MODELS
from loom.rundir.config_file import load_frozen
from loom.rundir.paths import RunDir
from loom.schema import typed


@dataclass(frozen=True)
class EvalRequest:
    """One `loom eval`, checked."""

    export: Request      # the chosen weights' export, hf or loom (made, or reused when done)
    ev: DictConfig       # an EvalConfig: the tasks and lm-eval's settings
    tokenizer: str       # the run's tokenizer (a path or cached name), or "bytes"
    max_length: int      # tokens of context the model is given


def _usage(what: str) -> ConfigError:
    return ConfigError(f"Invalid usage: loom eval {what}.")


def _as_eval(e: ConfigError) -> ConfigError:
    """Export's, generate's and the checks' refusals, worded for this verb."""
    text = str(e).replace("loom export", "loom eval", 1).replace("loom generate", "loom eval", 1)
    return ConfigError(text.replace("Invalid config: eval.tasks", "Invalid usage: loom eval --tasks", 1))


def export_format(cfg: DictConfig) -> str:
    """hf: a model with a transformers architecture is scored as transformers loads its export (what
    `lm_eval --model hf` scores); loom: another (GPT) is Loom's own network over `--format loom`."""
    return "hf" if MODELS[cfg.model.name].hf_config is not None else "loom"


def settings(cfg: DictConfig, tasks: list[str], **flags: int | None) -> DictConfig:
    """The run's `eval` section (a run frozen before it existed: the defaults), flags over it."""
    node = OmegaConf.to_container(cfg.eval) if "eval" in cfg else {}
    node.update({"tasks": tasks, **{k: v for k, v in flags.items() if v is not None}})
    return typed("eval", EvalConfig, node)


def request(run: str, tasks: list[str], *, step: int | None = None, limit: int | None = None,
            num_fewshot: int | None = None, batch_size: int | None = None) -> EvalRequest:
    """Everything `loom eval` was asked, checked against the run dir (ConfigError: exit 2)."""
    tasks = [t for t in tasks if t]
    if not tasks:
        raise _usage(f"{run}: say which tasks: --tasks a,b (lm-eval task names, Loom's tinycode_mc, "
                     "tinycode_complete, tinycode_ppl, or paths to task YAML files)")
    for flag, value, least in (("--limit", limit, 1), ("--num-fewshot", num_fewshot, 0), ("--batch-size", batch_size, 1)):
        if value is not None and value < least:
            raise _usage(f"{run} {flag} {value}: must be {least} or more")
    try:
        run_dir = run_dir_of(run)
        cfg = load_frozen(RunDir(run_dir).config)
        ev = settings(cfg, tasks, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size)
        check_tasks(OmegaConf.merge(cfg, {"eval": ev}))
        export = export_request(str(run_dir), export_format(cfg), None, step, None)
    except ConfigError as e:
        raise _as_eval(e) from None
    max_length = eval_length(OmegaConf.merge(cfg, {"eval": ev}))
    return EvalRequest(export, ev, str(text_encoding(cfg)), max_length)
