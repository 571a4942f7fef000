"""Chat templates in the shapes of three families (local Jinja, no download) and a tokenizer
that knows their special tokens, for the chat tests and the SFT reference runs."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# rewrites earlier turns: the number of messages comes first (a prefix's rendering is not a prefix)
REWRITING = "{{ messages | length }} turns\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>", "[INST]", "[/INST]", "<s>", "</s>"]


def make_chat_tokenizer(dest: Path, template: str | None, bos: str = "<s>", eos: str = "</s>",
                        vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer with the families' special tokens, saved with save_pretrained,
    and `template` as its chat_template.jinja (None: a tokenizer without a template)."""
    from tests_helpers import CORPUS
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", *SPECIAL],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10 + ["Hello there. How are you? Sure, here it is."] * 10, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos, eos_token=eos,
                                   additional_special_tokens=[t for t in SPECIAL if t not in (bos, eos)])
    fast.save_pretrained(str(dest))
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)
    return dest


CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello there."},
                  {"role": "user", "content": "How are you?"},
                  {"role": "assistant", "content": "Fine, thanks."}]},
    {"messages": [{"role": "user", "content": "the quick brown fox"},
                  {"role": "assistant", "content": "jumps over the lazy dog."}]},
    {"messages": [{"role": "user", "content": "def add(a, b):"},
                  {"role": "assistant", "content": "    return a + b"},
                  {"role": "user", "content": "pack my box"},
                  {"role": "assistant", "content": "with five dozen liquor jugs!"}]},
]


def write_chats(path: Path, n: int, rows: list[dict] | None = None) -> Path:
    """`n` conversations (the three above, varied by index) as JSON lines."""
    rows = rows or [dict(CONVERSATIONS[i % len(CONVERSATIONS)],
                         messages=[dict(m, content=m["content"] + ("" if m["role"] == "system" else f" {i}"))
                                   for m in CONVERSATIONS[i % len(CONVERSATIONS)]["messages"]])
                    for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
