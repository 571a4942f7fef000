"""One preference row as (prompt, chosen, rejected) messages, and one pair rendered into token ids.

Rows take TRL's layouts: `prompt` + `chosen` + `rejected`, each a string or a list of {role,
content} messages (a string prompt is a user message, a string completion an assistant message);
or, with no prompt, `chosen` and `rejected` as whole conversations sharing a prefix, split at the
first message that differs (the shared messages are the prompt, as `trl.extract_prompt` splits them).

A side renders as `apply_chat_template(prompt + completion)` tokenizes it (no special tokens added:
the template writes them). The completion starts where the tokenized prompt (rendered with the
generation prompt) stops being a prefix of either side's ids, the earlier of the two (TRL's
DPOTrainer rule: a token merged across the boundary belongs to the completion), so both sides share
their first `prompt` tokens and every token after them is trained. A template whose prompt rendering is not a prefix of the pair's
(it rewrites earlier turns) is refused with the row rather than trained with a wrong split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loom.data.conversation.render import RowError, checked, require_prefix, row_tools
from loom.data.conversation.template import ChatTemplate

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    tools: list | None = None

    @property
    def identical(self) -> bool:
        return self.chosen == self.rejected


@dataclass(frozen=True)
class RenderedPair:
    chosen: np.ndarray    # int64 ids of prompt + chosen
    rejected: np.ndarray  # int64 ids of prompt + rejected
    prompt: int           # the untrained prefix both share (tokens)


def _completion(value: Any, column: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value:
        return checked(value, f"'{column}' message")
    raise RowError(f"its '{column}' is neither a string nor a list of {{role, content}} messages (got "
                   f"{type(value).__name__}: {str(value)[:30]!r})")


def _split(chosen: Any, rejected: Any, columns: tuple[str, str]) -> tuple[list[dict], list[dict], list[dict]]:
    """(shared prompt, chosen rest, rejected rest) of two whole conversations."""
    if not (isinstance(chosen, list) and chosen and isinstance(rejected, list) and rejected):
        raise RowError(f"has no prompt, so its '{columns[0]}' and '{columns[1]}' must be whole conversations (lists "
                       "of messages) sharing the prompt")
    c, r = checked(chosen, f"'{columns[0]}' message"), checked(rejected, f"'{columns[1]}' message")
    k = next((i for i, (a, b) in enumerate(zip(c, r, strict=False)) if a != b), min(len(c), len(r)))
    if k == 0 and c != r:
        raise RowError(f"its '{columns[0]}' and '{columns[1]}' differ at their first message: no shared prompt "
                       "(give a prompt column)")
    return c[:k], c[k:], r[k:]


def pair_of(row: dict, prompt_column: str, chosen_column: str, rejected_column: str) -> Pair:
    """The row's pair, checked (RowError: a missing or malformed side, no prompt to split off)."""
    for column in (chosen_column, rejected_column):
        if row.get(column) is None:
            raise RowError(f"has no '{column}' (columns: {sorted(k for k, v in row.items() if v is not None)})")
    prompt = row.get(prompt_column)
    if prompt is None:
        prompt, chosen, rejected = _split(row[chosen_column], row[rejected_column], (chosen_column, rejected_column))
    else:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            prompt = checked(prompt, f"'{prompt_column}' message")
        else:
            raise RowError(f"its '{prompt_column}' is neither a string nor a list of {{role, content}} messages (got "
                           f"{type(prompt).__name__}: {str(prompt)[:30]!r})")
        chosen, rejected = _completion(row[chosen_column], chosen_column), _completion(row[rejected_column],
                                                                                      rejected_column)
    return Pair(prompt, chosen, rejected, row_tools(row))


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def render_pair(template: ChatTemplate, tokenizer: Any, pair: Pair, columns: tuple[str, str]) -> RenderedPair:
    """Both sides' ids and their shared untrained prefix (RowError: a completion that does not start
    with the assistant's reply, a template that rewrites the prompt, a completion with no token)."""
    for side, column in zip((pair.chosen, pair.rejected), columns, strict=True):
        if not side:
            raise RowError(f"its '{column}' has nothing after the shared prompt")
        if side[0]["role"] != "assistant":
            raise RowError(f"its '{column}' completion starts with a {side[0]['role']} message: a completion starts "
                           "with the assistant's reply")
    head = template.render(pair.prompt, add_generation_prompt=True, tools=pair.tools)
    texts = [template.render(pair.prompt + side, tools=pair.tools) for side in (pair.chosen, pair.rejected)]
    for text, column in zip(texts, columns, strict=True):
        require_prefix(head, text, "of the prompt with the generation prompt", f"prompt + '{column}'",
                       "use dataset.chat_template with a template that does not")

    def ids(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    prompt_ids, chosen, rejected = ids(head), ids(texts[0]), ids(texts[1])
    prompt = min(_common(prompt_ids, chosen), _common(prompt_ids, rejected))
    for side, column in ((chosen, columns[0]), (rejected, columns[1])):
        if len(side) - max(prompt, 1) < 1:
            raise RowError(f"its '{column}' completion renders to no token")
    return RenderedPair(chosen, rejected, prompt)
