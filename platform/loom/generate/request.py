"""What `loom generate` was asked, checked torch-free: the run, its weights (export's selection:
final/ or `--step N`'s checkpoint, as `loom export` picks them), the sampling settings, the
tokenizer and, under `--chat`, a chat template. A bad request exits 2 with one paragraph before
torch is imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loom.data import chat_template_file
from loom.errors import ConfigError
from loom.export import Request
from loom.export import request as export_request
from loom.export.select import run_dir_of
from loom.models.registry import FAMILIES, MODELS
from loom.rundir.config_file import load_frozen
from loom.rundir.paths import RunDir

# where a tokenizer directory keeps its chat template (transformers' save_pretrained writes the first)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class Settings:
    """How tokens are drawn: greedy at temperature 0, else sampled (top-p) from `seed`."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    """One `loom generate`, checked."""

    export: Request  # the Hugging Face export of the chosen weights (made, or reused when done)
    prompt: str | None  # None: --chat
    settings: Settings
    tokenizer: str | None  # the run's dataset.tokenizer; None: byte-level (UTF-8 bytes are the ids)
    chat_template: Path | None  # the run's dataset.chat_template file, over the tokenizer's own


def _usage(what: str) -> ConfigError:
    return ConfigError(f"Invalid usage: loom generate {what}.")


def _check_settings(run: str, prompt: str | None, chat: bool, s: Settings) -> None:
    if prompt is None and not chat:
        raise _usage(f"{run}: say what to answer: --prompt TEXT (one continuation) or --chat (turns read from "
                     "stdin, one a line)")
    if prompt is not None and chat:
        raise _usage(f"{run} --prompt ... --chat: choose one (--prompt: one continuation; --chat: a conversation "
                     "read from stdin)")
    if prompt == "":
        raise _usage(f"{run} --prompt '': give the text to continue")
    if s.max_new_tokens < 1:
        raise _usage(f"{run} --max-new-tokens {s.max_new_tokens}: a count of tokens, 1 or more (default 64)")
    if not s.temperature >= 0:
        raise _usage(f"{run} --temperature {s.temperature}: 0 (greedy, the default) or more (sampled)")
    if not 0 < s.top_p <= 1:
        raise _usage(f"{run} --top-p {s.top_p}: a probability mass in (0, 1] (1: no cut, the default)")


def _check_model(cfg, run_dir: Path) -> None:
    """Generation runs the Hugging Face export through transformers: the model needs an architecture."""
    if MODELS[cfg.model.name].hf_config is not None:
        return
    able = ", ".join(f.name for f in FAMILIES if f.hf_config is not None)
    raise _usage(f"{run_dir}: model={cfg.model.name} has no Hugging Face architecture, and generation runs the "
                 f"run's Hugging Face export with transformers (models that have one: {able}); "
                 f"`loom export {run_dir} --format loom` writes its weights")


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a tokenizer directory carries a chat template (read without transformers)."""
    if any((tokenizer_dir / f).is_file() for f in TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _check_chat(run_dir: Path, tokenizer: str | None, template: str | None) -> Path | None:
    """--chat renders turns with a template: the run's dataset.chat_template file, else its
    tokenizer's (a tokenizer by cached name is checked once loaded). Returns the file, if any."""
    if tokenizer is None:
        raise _usage(f"{run_dir} --chat: the run has no tokenizer (dataset.tokenizer=null: byte-level tokens), "
                     "so no chat template renders its turns; use --prompt TEXT")
    if template is not None:
        path = Path(template).expanduser()
        if not path.is_file():
            raise _usage(f"{run_dir} --chat: the run's dataset.chat_template={template} is no file here; put the "
                         "template back there, or use --prompt TEXT")
        return path
    local = Path(tokenizer).expanduser()
    if local.is_dir() and not has_chat_template(local):
        raise _usage(f"{run_dir} --chat: the run's tokenizer dataset.tokenizer={tokenizer} has no chat template "
                     f"(no chat_template in tokenizer_config.json, no {' or '.join(TEMPLATE_FILES)}) and the run "
                     "sets no dataset.chat_template; use --prompt TEXT")
    return None


def _as_generate(e: ConfigError) -> ConfigError:
    """Export's refusal of the run dir or the step, worded for this verb."""
    return ConfigError(str(e).replace("loom export", "loom generate", 1))


def request(run: str, prompt: str | None, chat: bool, step: int | None, settings: Settings) -> GenerateRequest:
    """Everything `loom generate` was asked, checked against the run dir (ConfigError: exit 2)."""
    _check_settings(run, prompt, chat, settings)
    try:
        run_dir = run_dir_of(run)
    except ConfigError as e:
        raise _as_generate(e) from None
    cfg = load_frozen(RunDir(run_dir).config)
    _check_model(cfg, run_dir)
    tokenizer = cfg.dataset.get("tokenizer") or None
    template = chat_template_file(cfg.dataset)
    template_file = _check_chat(run_dir, tokenizer, template) if chat else None
    try:
        export = export_request(str(run_dir), "hf", None, step, None)
    except ConfigError as e:
        raise _as_generate(e) from None
    return GenerateRequest(export, prompt, settings, str(tokenizer) if tokenizer else None, template_file)
