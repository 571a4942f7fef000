"""The task checks of `eval.tasks` at validation (exit 2 before anything launches): every name
resolves in lm-eval's registry or the given task YAMLs (an unknown one lists the closest names),
every task's dataset is on local disk (evaluation is offline by design), and the run's model can
take the tasks (text goes in through a tokenizer or the bytes themselves; a generation task's
budget of new tokens fits in the model's context). Imports lm_eval's task index, so
`loom.eval.check` calls this only when eval.tasks is non-empty."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.eval.registry import is_path, manager_for
from loom.eval.schema import eval_length

# datasets' builders that read local files (dataset_kwargs.data_files), not a Hub repository.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
LMEVAL_MAX_GEN_TOKS = 256  # HFLM's budget of new tokens where a task names none


def text_encoding(cfg: DictConfig) -> str | None:
    """How the run's text becomes ids (the dataset option says): its tokenizer, "bytes" (read with
    loom.eval.engine.byte_tokenizer), or None."""
    from loom.data import text_encoding as dataset_encoding

    return dataset_encoding(cfg.dataset)


def check_tasks(cfg: DictConfig) -> None:
    ev = cfg.eval
    for entry in ev.tasks:
        if is_path(entry) and not Path(entry).expanduser().exists():
            raise ConfigError(f"Invalid config: eval.tasks entry {entry} is not a file or directory here; "
                              "give a task YAML file, a directory of them, or a task name.")
    names, manager = manager_for(list(ev.tasks))
    for name in names:
        if name not in manager.task_index:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            hint = f" Closest names: {', '.join(close)}." if close else ""
            raise ConfigError(f"Invalid config: eval.tasks: unknown task {name!r}: not in lm-eval's registry, "
                              f"Loom's shipped tasks or the given task YAMLs.{hint} `python -m lm_eval ls tasks` "
                              "lists them all; a task YAML of your own goes in as a path.")
    if text_encoding(cfg) is None:
        raise ConfigError(f"Invalid config: eval.tasks={list(ev.tasks)} needs text, but dataset={cfg.dataset.name} "
                          "has no tokenizer (its ids are not text): set dataset.tokenizer=<a local Hugging Face "
                          "tokenizer>, or train on a text dataset (without a tokenizer its text is UTF-8 bytes).")
    if ev.apply_chat_template and text_encoding(cfg) == "bytes":
        raise ConfigError("Invalid config: eval.apply_chat_template=true renders each request with the tokenizer's chat "
                          "template, and this run has none (dataset.tokenizer=null: its text is UTF-8 bytes); drop it.")
    max_length = eval_length(cfg)
    for name in names:
        for task, tc in leaves(manager, name):
            check_local(task, tc)
            check_fits(task, tc, max_length)


def leaves(manager: Any, name: str, depth: int = 0) -> list[tuple[str, dict]]:
    """(task, its YAML config) of every task `name` stands for (a group's or tag's members)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(name)
    if entry is None or depth > 8:
        return []
    kind = getattr(entry.kind, "name", str(entry.kind)).upper()
    if kind == "TAG":
        return [leaf for member, e in manager.task_index.items() if name in e.tags
                for leaf in leaves(manager, member, depth + 1)]
    if entry.yaml_path is None:
        return [(name, entry.cfg)] if entry.cfg else []
    tc = load_yaml(entry.yaml_path, resolve_func=False)
    if kind == "GROUP":
        members = tc.get("task", [])
        return [leaf for m in (members if isinstance(members, list) else [members])
                for leaf in (leaves(manager, m, depth + 1) if isinstance(m, str) else [(str(m.get("task")), m)])]
    return [(name, tc)]


def _hf_caches() -> tuple[Path, Path]:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    return hub, Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()


def in_local_cache(path: str) -> bool:
    """Whether the Hub dataset `path` has a copy in this machine's Hugging Face caches."""
    hub, ds = _hf_caches()
    return (hub / f"datasets--{path.replace('/', '--')}").is_dir() or (ds / path.replace("/", "___")).is_dir()


def check_local(task: str, tc: dict) -> None:
    """A task reads its documents from this disk: its own loader, local files, or the HF cache."""
    path = tc.get("dataset_path")
    if tc.get("custom_dataset") or path is None or path in LOCAL_BUILDERS:
        return
    if Path(str(path)).expanduser().exists() or in_local_cache(str(path)):
        return
    hub, ds = _hf_caches()
    config = tc.get("dataset_name")
    load = f"datasets.load_dataset({str(path)!r}{f', {config!r}' if config else ''})"
    raise ConfigError(
        f"Invalid config: eval.tasks: task {task} reads the dataset {path} from the Hugging Face Hub, and it is "
        f"not on this machine's disk (not in {hub} or {ds}); Loom evaluates offline. Make it local: run "
        f"`python -c \"import datasets; {load}\"` where there is network, copy the cache here (HF_HOME) and set "
        "HF_DATASETS_OFFLINE=1; or write a task YAML over a local copy (dataset_path: json, "
        "dataset_kwargs.data_files: /path/to/docs.jsonl) and give its path in eval.tasks.")


def check_fits(task: str, tc: dict, max_length: int) -> None:
    """A generation task's new tokens leave room for its prompt in the model's context."""
    if tc.get("output_type") != "generate_until":
        return
    budget = int((tc.get("generation_kwargs") or {}).get("max_gen_toks", LMEVAL_MAX_GEN_TOKS))
    if budget >= max_length:
        raise ConfigError(
            f"Invalid config: eval.tasks: task {task} generates up to {budget} tokens (max_gen_toks), which leaves "
            f"no room for its prompt in the model's context of {max_length} tokens (eval.max_length, or "
            "dataset.seq_len); train with a longer context or give the task a smaller max_gen_toks.")
