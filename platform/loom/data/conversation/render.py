"""Which tokens of a conversation are trained, derived by rendering it prefix by prefix.

transformers' `return_assistant_tokens_mask` needs `{% generation %}` markers in the template
and silently returns an all-zero or all-one mask without them (Qwen3 #1522, Megatron-Bridge
#3927). Here the mask does not depend on markers: the conversation is rendered after each of
its messages; the characters message k adds (render(m[:k+1]) minus render(m[:k])) belong to
its role. For an assistant message the generation prompt is rendered too
(render(m[:k], add_generation_prompt=True)): the header it adds (`<|im_start|>assistant\\n`) is
prompt, only the rest (the reply and its end-of-turn token) is the assistant's. Every render
must be a prefix of the next, or the split would be wrong: such a template (one that rewrites
earlier turns, e.g. dropping past reasoning) is refused, naming the row, rather than trained
with a silently wrong mask.

The whole conversation is tokenized once (no special tokens added: the template writes them,
as `apply_chat_template` does); a token is trained when any of its characters is in a trained
span. A token can straddle a boundary (byte-level BPE joins the header's `\n` to a reply's
leading spaces); it is trained, so no character of a reply goes untrained. Labels are the next
tokens, so the count of trained targets is `mask[1:].sum()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loom.data.conversation.template import ChatTemplate, TemplateError

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
TRAIN_ON = ("assistant", "all", "last")
FORMATS = ("messages", "prompt_completion")


class RowError(ValueError):
    """One row cannot be trained (the message says why; the caller names the row)."""


@dataclass(frozen=True)
class Rendered:
    ids: np.ndarray     # int64 token ids of the whole conversation
    mask: np.ndarray    # uint8, 1 where the token is trained (as a target)

    @property
    def trained(self) -> int:
        """Targets trained (labels are next tokens: the first token is never a target)."""
        return int(self.mask[1:].sum())


def conversation(row: dict, fmt: str, column: str) -> tuple[list[dict], list | None]:
    """(messages, tools) of one row, checked: RowError for a missing column, an unknown role,
    a message without a string content (an assistant's tool calls may stand for its content)."""
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowError(f"needs string 'prompt' and 'completion' (has {sorted(row)})")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], None
    messages = row.get(column)
    if not isinstance(messages, list) or not messages:
        raise RowError(f"has no '{column}' list of messages (columns: {sorted(row)}); dataset.format="
                       "prompt_completion reads 'prompt'/'completion' pairs")
    return checked(messages), row_tools(row)


def checked(messages: list, what: str = "message") -> list[dict]:
    """The messages, checked (RowError naming `what` k: not a {role, content} dict, an unknown role,
    a non-string content where no tool call stands for it), their None fields left out."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"{what} {i} is a {type(m).__name__}, not {{role, content}}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowError(f"{what} {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise RowError(f"{what} {i} ({role}) has a {type(content).__name__} content, not a string")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def row_tools(row: dict) -> list | None:
    """A row's tool definitions (a non-empty `tools` list), for the template."""
    tools = row.get("tools")
    return tools if isinstance(tools, list) and tools else None


def _render(template: ChatTemplate, messages: list[dict], tools: list | None, gen: bool = False) -> str:
    return template.render(messages, add_generation_prompt=gen, tools=tools)


def require_prefix(before: str, after: str, what: str, of: str = "the next rendering",
                   fix: str = "use dataset.chat_template with a template that does not, or dataset.train_on=all") -> None:
    """RowError unless the rendering `what` (`before`) is a prefix of `of` (`after`), naming where they differ:
    a template that rewrites earlier turns leaves the trained tokens underivable."""
    if not after.startswith(before):
        at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
        raise RowError(f"the template's rendering {what} is not a prefix of {of} (they differ at character {at}: "
                       f"{before[at:at + 30]!r} vs {after[at:at + 30]!r}): the template rewrites earlier turns, so "
                       f"which tokens are trained cannot be derived; {fix}")


def trained_spans(template: ChatTemplate, messages: list[dict], tools: list | None,
                  train_on: str) -> tuple[str, list[tuple[int, int]]]:
    """(the whole rendering, the character spans trained), by prefix rendering (module doc)."""
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on != "all" and not assistants:
        raise RowError("has no assistant message: nothing to train on (dataset.train_on=all trains every token)")
    try:
        text = _render(template, [], tools)
    except TemplateError:
        text = ""  # templates that index messages[0] cannot render no message: nothing before it
    spans: list[tuple[int, int]] = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            head = _render(template, messages[:k], tools, gen=True) if k else text
            require_prefix(text, head, f"of the first {k} message(s) with the generation prompt")
            text = head
        full = _render(template, messages[:k + 1], tools)
        require_prefix(text, full, f"of the first {k} message(s)")
        if train_on == "all" or (m["role"] == "assistant" and (train_on == "assistant" or k == assistants[-1])):
            spans.append((len(text), len(full)))
        text = full
    if train_on == "all":
        spans = [(0, len(text))]
    return text, spans


def render(template: ChatTemplate, tokenizer: Any, messages: list[dict], tools: list | None,
           train_on: str) -> Rendered:
    """Token ids and trained mask of one conversation. `tokenizer`: a `tokenizers.Tokenizer`."""
    text, spans = trained_spans(template, messages, tools, train_on)
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)  # a zero-width token: its start
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts < hi) & (ends > lo)] = 1
    out = Rendered(ids, mask)
    if out.trained == 0:
        raise RowError("renders to no trainable token (its trained text is empty, or is the first token)")
    return out
