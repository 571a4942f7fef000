"""The torch half of `loom generate`: the run's Hugging Face export (made by loom.export, or
reused when `<run>/export/hf-step-<N>` already holds it), loaded with transformers'
AutoModelForCausalLM, and text drawn by its own `generate` (greedy at temperature 0, else
sampling with top-p from the seed). Nothing of decoding is written here: the export is what
transformers loads, so what Loom prints is what transformers computes for it.

Text becomes ids the way the run's data did: the tokenizer without special tokens added (loom
data's encoder), or, for a byte-level run (dataset.tokenizer=null), the UTF-8 bytes themselves.
Ids the model has and the data cannot produce (a vocabulary padded past the tokenizer's, or
past 256 bytes) are suppressed: training never scored them, so their logits mean nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import torch

from loom.errors import EXIT_OK, ConfigError
from loom.export.select import Request
from loom.export.write import export as write_export
from loom.generate.request import GenerateRequest, Settings


class ByteCodec:
    """A byte-level run's ids: UTF-8 bytes (undecodable bytes print as U+FFFD)."""

    size = 256
    eos_ids: list[int] = []
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    """The run's Hugging Face tokenizer, as its data encoded text (no special tokens added)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.size = len(tokenizer)
        self.eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.chat_template = tokenizer.chat_template

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, turns: list[dict[str, str]], template: str | None) -> str:
        """The conversation so far, with the assistant's turn opened (the template's own rule)."""
        return self.tok.apply_chat_template(turns, chat_template=template, add_generation_prompt=True,
                                            tokenize=False)


def load_codec(req: GenerateRequest) -> ByteCodec | TokenizerCodec:
    if req.tokenizer is None:
        return ByteCodec()
    return TokenizerCodec(run_tokenizer(req.tokenizer, "generate", req.export.run_dir))


def run_tokenizer(path: str, verb: str, run_dir: Path):
    """The run's tokenizer from local files (`loom generate` and `loom eval`); gone: exit 2 saying where."""
    from loom.data.tokenizer import TokenizerUnavailable, load_tokenizer

    try:
        return load_tokenizer(path)
    except TokenizerUnavailable as e:
        raise ConfigError(f"Invalid usage: loom {verb} {run_dir}: the run's tokenizer "
                          f"dataset.tokenizer={path} is not available here ({e}); put it back at that "
                          "path or in the Hugging Face cache.") from None


def exported_once(exp: Request, verb: str, log: TextIO) -> Path:
    """The export of the chosen weights (`loom generate`, `loom eval`): reused when complete, else written."""
    what = f"{exp.source.describe(exp.run_dir)} of run {exp.cfg.run.id}"
    if exp.done():
        print(f"loom {verb}: {what}, exported in {exp.out}", file=log)
    else:
        print(f"loom {verb}: exporting {what} to {exp.out} (--format {exp.fmt})", file=log)
        write_export(exp)
    return exp.out


def load_model(path: Path) -> torch.nn.Module:
    """from_pretrained of the export, in its own dtype, on the GPU when there is one."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the verb says what it loads in one line of its own
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def _stop_ids(model, codec) -> list[int]:
    """End of text: the tokenizer's EOS and whatever the model's generation config names."""
    named = model.generation_config.eos_token_id
    named = [] if named is None else [named] if isinstance(named, int) else list(named)
    return list(dict.fromkeys([*codec.eos_ids, *named]))


def generate_ids(model, codec, ids: list[int], s: Settings) -> list[int]:
    """The new ids transformers' `generate` draws after `ids` (greedy at temperature 0)."""
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and len(ids) + s.max_new_tokens > context:
        raise ConfigError(f"Invalid usage: loom generate: {len(ids)} tokens of input + --max-new-tokens "
                          f"{s.max_new_tokens} exceed the model's context of {context} tokens; shorten the input or "
                          "lower --max-new-tokens.")
    stop = _stop_ids(model, codec)
    vocab = int(model.config.get_text_config().vocab_size)
    sampling = {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": 0} if s.temperature \
        else {"do_sample": False}
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=s.max_new_tokens,
                             eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0,
                             suppress_tokens=list(range(codec.size, vocab)) or None, **sampling)
    return out[0, len(ids):].tolist()  # an end-of-text id last, if one stopped it (decode skips it)


def _turns(stdin: TextIO):
    """User turns, one a line: a TTY prompts for each; EOF or an empty line ends the chat."""
    interactive = stdin.isatty()
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except EOFError:
            return
        if not line.strip():
            return
        yield line.rstrip("\n")


def chat(model, codec: TokenizerCodec, s: Settings, template: str | None, stdin: TextIO, stdout: TextIO) -> None:
    """Each user line answered with the whole conversation so far rendered by the template."""
    turns: list[dict[str, str]] = []
    for line in _turns(stdin):
        turns.append({"role": "user", "content": line})
        ids = codec.encode(codec.render(turns, template))
        reply = codec.decode(generate_ids(model, codec, ids, s)).strip()
        turns.append({"role": "assistant", "content": reply})
        print(reply, file=stdout, flush=True)


def run(req: GenerateRequest) -> int:
    """`loom generate`: the export, the model, then one continuation or a conversation."""
    codec = load_codec(req)
    template = req.chat_template.read_text() if req.chat_template is not None else None
    if req.prompt is None and template is None and not codec.chat_template:
        raise ConfigError(f"Invalid usage: loom generate {req.export.run_dir} --chat: the run's tokenizer "
                          f"dataset.tokenizer={req.tokenizer} has no chat template and the run sets no "
                          "dataset.chat_template; use --prompt TEXT.")
    model = load_model(exported_once(req.export, "generate", sys.stderr))
    torch.manual_seed(req.settings.seed)
    if req.prompt is None:
        chat(model, codec, req.settings, template, sys.stdin, sys.stdout)
        return EXIT_OK
    new = generate_ids(model, codec, codec.encode(req.prompt), req.settings)
    print(codec.decode(new), flush=True)
    print(f"loom generate: {len(new)} new tokens", file=sys.stderr)
    return EXIT_OK
