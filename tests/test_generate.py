"""`loom generate RUN_DIR --prompt TEXT | --chat` (loom.generate): text from a run's weights
through their Hugging Face export and transformers' own `generate`.

No launch of its own: the run dirs are made here as test_export.py makes them (a frozen
config.yaml of llama_tiny with a tokenizer made here, checkpoints of steps 2 and 4). Each check
compares the CLI's text with what transformers computes, built independently in the test from
the export directory: `from_pretrained(...).generate(...)`. A LoRA run (test_export_lora.py's)
is compared with peft's own model, and the shared fsdp Llama run's DCP checkpoint of step 5 (a
sharded checkpoint, read in one process) with its export.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launching_fixture
from omegaconf import OmegaConf
from test_export import _fake_run, _loom
from test_export_lora import lora_run  # noqa: F401  (a LoRA run dir made in-process)
from test_llama_runs import completed_llama_runs
from tests_helpers import assert_refused_without_torch, make_tokenizer

PROMPT = "def add(a, b):"
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Fake runs of llama_tiny (vocabulary 512): with a tokenizer of 320 ids without a chat
    template, with one that has a template, byte-level, and a gpt_tiny run."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("generate")
    plain = make_tokenizer(root / "tok", 320)
    chat_tok = AutoTokenizer.from_pretrained(plain)
    chat_tok.chat_template = CHATML
    chat_tok.save_pretrained(root / "chat-tok")
    out = {"plain": _fake_run(root / "plain", "llama_tiny", (2, 4), None, f"dataset.tokenizer={plain}")[0],
           "chat": _fake_run(root / "chat", "llama_tiny", (2, 4), None, f"dataset.tokenizer={root / 'chat-tok'}")[0],
           "bytes": _fake_run(root / "bytes", "llama_tiny", (3,))[0],
           "gpt": _fake_run(root / "gpt", "gpt_tiny", ())[0]}
    (root / "other.jinja").write_text(OTHER)
    out["file"] = _with_dataset_key(root / "file", out["plain"], "chat_template", str(root / "other.jinja"))
    out["missing"] = _with_dataset_key(root / "missing", out["plain"], "chat_template", str(root / "gone.jinja"))
    return out


def _with_dataset_key(dest: Path, run: Path, key: str, value: str) -> Path:
    """A copy of `run` whose config sets dataset.<key> of dataset=chat (the run's data is then chat's)."""
    import shutil

    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("export"))
    cfg = OmegaConf.load(dest / "config.yaml")
    cfg.dataset.name = "chat"
    cfg.dataset[key] = value
    OmegaConf.save(cfg, dest / "config.yaml")
    return dest


def _reference(export: Path, ids: list[int], new: int, used: int, eos: int | None,
               sample: tuple[float, float, int] | None = None) -> list[int]:
    """transformers' own generate on the export: greedy, or (temperature, top_p, seed) sampled;
    ids past the tokenizer's `used` suppressed (a padded vocabulary's rows never trained)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    how = {"do_sample": False}
    if sample is not None:
        how = {"do_sample": True, "temperature": sample[0], "top_p": sample[1], "top_k": 0}
        torch.manual_seed(sample[2])
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, eos_token_id=eos,
                             pad_token_id=eos if eos is not None else 0,
                             suppress_tokens=list(range(used, model.config.vocab_size)), **how)
    return out[0, len(ids):].tolist()


def _tokenizer(run: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(OmegaConf.load(run / "config.yaml").dataset.tokenizer)


def _decoded(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_greedy_text_is_transformers_greedy_output_of_the_export_token_for_token(runs):
    """The newest checkpoint by default, `--step 2` another: each exported once under
    <run>/export/hf-step-<N> (reused by the next call), the text transformers' greedy decoding
    of that export gives, with as many tokens."""
    run, tok = runs["plain"], _tokenizer(runs["plain"])
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    texts = {}
    for step in (4, 2):
        argv = ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "24"]
        rc, out, err = _loom(*argv, *(["--step", "2"] if step == 2 else []))
        assert rc == 0, err
        export = run / "export" / f"hf-step-{step}"
        assert f"exporting checkpoints/step-{step:07d}.ckpt (step {step})" in err and str(export) in err, err
        want = _reference(export, ids, 24, len(tok), tok.eos_token_id)
        assert out == _decoded(tok, want) + "\n" and f"{len(want)} new tokens" in err, (out, err)
        texts[step] = out
        rc, again, err = _loom(*argv, *(["--step", "2"] if step == 2 else []))
        assert rc == 0 and again == out and "exported in" in err and "exporting" not in err, err
    assert texts[2] != texts[4]


def test_sampling_is_transformers_sampling_from_the_seed(runs):
    run, tok = runs["plain"], _tokenizer(runs["plain"])
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    outs = {}
    for seed in (1, 2):
        rc, out, err = _loom("generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "16",
                             "--temperature", "3.0", "--top-p", "0.95", "--seed", str(seed))
        assert rc == 0, err
        want = _reference(run / "export" / "hf-step-4", ids, 16, len(tok), tok.eos_token_id, (3.0, 0.95, seed))
        assert out == _decoded(tok, want) + "\n", out
        outs[seed] = out
    assert outs[1] != outs[2]


@pytest.mark.parametrize("name,template", [("chat", CHATML), ("file", OTHER)])
def test_chat_answers_each_stdin_line_with_the_conversation_so_far(runs, monkeypatch, name, template):
    """Two lines on stdin, two replies: each the greedy continuation of the whole conversation
    rendered by the tokenizer's template, or the run's dataset.chat_template file over it."""
    run = runs[name]
    tok = _tokenizer(run)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand again\n\nnot read\n"))
    rc, out, err = _loom("generate", str(run), "--chat", "--max-new-tokens", "12")
    assert rc == 0, err
    turns, replies = [], []
    for line in ("hello there", "and again"):
        turns.append({"role": "user", "content": line})
        text = tok.apply_chat_template(turns, chat_template=template, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        reply = _decoded(tok, _reference(run / "export" / "hf-step-4", ids, 12, len(tok), tok.eos_token_id)).strip()
        turns.append({"role": "assistant", "content": reply})
        replies.append(reply)
    assert out == "".join(r + "\n" for r in replies), (out, replies)


def test_a_byte_level_run_generates_utf8_bytes(runs):
    """No tokenizer: the prompt's UTF-8 bytes are the ids, ids past 255 are never drawn."""
    rc, out, err = _loom("generate", str(runs["bytes"]), "--prompt", PROMPT, "--max-new-tokens", "20")
    assert rc == 0, err
    want = _reference(runs["bytes"] / "export" / "hf-step-3", list(PROMPT.encode()), 20, 256, None)
    assert max(want) < 256 and out == bytes(want).decode("utf-8", errors="replace") + "\n", out


def test_a_lora_run_generates_what_peft_generates(lora_run):  # noqa: F811
    """Its export merges the adapter (peft's merge); greedy text equals peft's own model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rc, out, err = _loom("generate", str(lora_run["run"]), "--prompt", PROMPT, "--max-new-tokens", "20")
    assert rc == 0, err
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, lora_run["run"] / "final").eval()
    x = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        got = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                             suppress_tokens=list(range(256, base.config.vocab_size)), pad_token_id=0)
    want = got[0, x.shape[1]:].tolist()
    assert out == bytes(want).decode("utf-8", errors="replace") + "\n", (out, want)


def test_a_request_generate_cannot_serve_is_refused_without_torch(runs):
    """Each refusal: exit 2, one paragraph naming the value and the choices, torch never imported."""
    plain, chat = str(runs["plain"]), str(runs["chat"])
    cases = {
        "no run": ([str(runs["plain"].parent / "nowhere"), "--prompt", "x"], ["loom generate", "not a run dir"]),
        "gpt": ([str(runs["gpt"]), "--prompt", "x"], ["model=gpt_tiny has no Hugging Face architecture", "llama*",
                                                       "--format loom"]),
        "neither": ([plain], ["--prompt TEXT", "--chat"]),
        "both": ([chat, "--prompt", "x", "--chat"], ["choose one"]),
        "temperature": ([plain, "--prompt", "x", "--temperature", "-1"], ["--temperature -1.0", "0 (greedy"]),
        "top-p": ([plain, "--prompt", "x", "--top-p", "0"], ["--top-p 0.0", "(0, 1]"]),
        "tokens": ([plain, "--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens 0", "1 or more"]),
        "step": ([plain, "--prompt", "x", "--step", "3"], ["loom generate", "--step 3", "available steps: 2, 4"]),
        "bytes chat": ([str(runs["bytes"]), "--chat"], ["dataset.tokenizer=null", "use --prompt TEXT"]),
        "no template": ([plain, "--chat"], ["has no chat template", "dataset.chat_template"]),
        "template gone": ([str(runs["missing"]), "--chat"], ["dataset.chat_template=", "gone.jinja", "no file"]),
    }
    assert_refused_without_torch('generate', cases, ROOT)


@launching_fixture(scope="module")
def fsdp_run(shared):
    """tests/test_llama_runs.py's fsdp run (the same arguments: the same run as test_export's)."""
    return completed_llama_runs(shared, ("fsdp",))["fsdp"]


def test_a_sharded_checkpoint_generates_what_its_export_does(fsdp_run):
    """The fsdp run's DCP checkpoint of step 5 (both ranks' shards), read in one process."""
    run = fsdp_run.run_dir
    rc, out, err = _loom("generate", str(run), "--prompt", PROMPT, "--step", "5", "--max-new-tokens", "16")
    assert rc == 0, err
    want = _reference(run / "export" / "hf-step-5", list(PROMPT.encode()), 16, 256, None)
    assert out == bytes(want).decode("utf-8", errors="replace") + "\n", out
