"""A tokenizer's chat template, found and rendered as transformers renders it, without torch.

The template is `dataset.chat_template` (a Jinja file) when given, else the tokenizer's own:
`chat_template.jinja` beside it (transformers >= 4.47 saves it there) or `chat_template` in its
`tokenizer_config.json` (a string, or a list of named templates whose `default` is used).
Rendering goes through `transformers.utils.chat_template_utils.render_jinja_template`, the
function `apply_chat_template` itself calls (its sandboxed Jinja environment, `raise_exception`,
`tojson`, `strftime_now`), with the tokenizer's special tokens as variables (`bos_token`, ...),
so a conversation renders here exactly as `tokenizer.apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template cannot be found or does not render a conversation."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    source: str                 # where the template came from (for messages)
    text: str                   # the Jinja source
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: list | None = None) -> str:
        """The conversation as text, as `apply_chat_template(tokenize=False)` renders it."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools or None,
                                                chat_template=self.text,
                                                add_generation_prompt=add_generation_prompt, **self.special)
        except Exception as e:  # jinja2's errors and the template's own raise_exception
            raise TemplateError(f"the chat template ({self.source}) does not render it: "
                                f"{type(e).__name__}: {e}") from None
        return rendered[0]


def _tokenizer_config(tokenizer: Path) -> dict:
    path = tokenizer / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _own_template(tokenizer: Path, config: dict) -> tuple[str, str] | None:
    """(source, text) of the tokenizer's own template, or None."""
    jinja = tokenizer / "chat_template.jinja"
    if jinja.is_file():
        return str(jinja), jinja.read_text()
    raw = config.get("chat_template")
    if isinstance(raw, list):  # named templates: the default one
        raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(raw, str) and raw.strip():
        return f"{tokenizer / 'tokenizer_config.json'} chat_template", raw
    return None


def load_template(tokenizer: str | None, override: str | None) -> ChatTemplate:
    """The run's chat template and special tokens; TemplateError naming what is missing."""
    tok = Path(tokenizer).expanduser() if tokenizer else None
    config = _tokenizer_config(tok) if tok is not None and tok.is_dir() else {}
    special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise TemplateError(f"dataset.chat_template={override!r} is not a file (give a Jinja template file)")
        return ChatTemplate(str(path), path.read_text(), special)
    found = _own_template(tok, config) if tok is not None and tok.is_dir() else None
    if found is None:
        where = f"the tokenizer {tokenizer}" if tokenizer else "no dataset.tokenizer"
        raise TemplateError(f"{where} has no chat template (no chat_template.jinja, no chat_template in "
                            "tokenizer_config.json): set dataset.chat_template=PATH to a Jinja template file")
    return ChatTemplate(found[0], found[1], special)
