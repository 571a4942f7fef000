"""dataset=chat: assistant-only masks by prefix rendering (golden, three template families),
refusals before anything is written, packing, and the loss over the global batch's trained tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from chat_helpers import CHATML, CONVERSATIONS, LLAMA3, MISTRAL, REWRITING, make_chat_tokenizer, write_chats
from conftest import refused

from loom.data.conversation.render import RowError, conversation, render
from loom.data.conversation.template import load_template

TWO_TURNS = CONVERSATIONS[2]["messages"]


def _runs(tok, r) -> list[str]:
    """The trained tokens, decoded run by run (a run: consecutive trained tokens)."""
    out, cur = [], []
    for i, m in zip(r.ids.tolist(), r.mask.tolist(), strict=True):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    if cur:
        out.append(tok.decode(cur, skip_special_tokens=False))
    return out


def _rendered(tmp_path, template, messages, train_on="assistant", **kw):
    from transformers import AutoTokenizer

    from loom.data.prepare.encoding import load_backend

    d = make_chat_tokenizer(tmp_path / "tok", template, **kw)
    hf = AutoTokenizer.from_pretrained(str(d))
    r = render(load_template(str(d), None), load_backend(str(d))[0], messages, None, train_on)
    whole = hf.apply_chat_template(messages, tokenize=False)
    assert hf.decode(r.ids.tolist(), skip_special_tokens=False) == whole  # the text transformers renders
    return hf, r


@pytest.mark.parametrize("family,template,kw,expected", [
    ("llama3", LLAMA3, {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
     ["return a + b<|eot_id|>", "with five dozen liquor jugs!<|eot_id|>"]),  # its template trims
    ("chatml", CHATML, {"bos": "<s>", "eos": "<|im_end|>"},
     # the header's "\n" and the reply's indent are one token: trained (no reply character goes untrained)
     ["\n    return a + b<|im_end|>\n", "with five dozen liquor jugs!<|im_end|>\n"]),
    ("mistral", MISTRAL, {"bos": "<s>", "eos": "</s>"},
     ["     return a + b</s>", " with five dozen liquor jugs!</s>"]),
])
def test_golden_assistant_masks(tmp_path, family, template, kw, expected):
    """Exactly the assistants' replies and their end-of-turn tokens are trained; every header,
    system, user and generation-prompt token is not (decoded run by run)."""
    messages = [dict(m) for m in TWO_TURNS]
    tok, r = _rendered(tmp_path, template, messages, **kw)
    assert _runs(tok, r) == expected
    masked = tok.decode([i for i, m in zip(r.ids.tolist(), r.mask.tolist(), strict=True) if not m],
                        skip_special_tokens=False)
    assert "def add(a, b):" in masked and "pack my box" in masked and "assistant" not in "".join(expected)
    assert r.trained == int(r.mask[1:].sum()) > 0


def test_train_on_last_and_all(tmp_path):
    tok, last = _rendered(tmp_path, CHATML, [dict(m) for m in TWO_TURNS], train_on="last", eos="<|im_end|>")
    assert _runs(tok, last) == ["with five dozen liquor jugs!<|im_end|>\n"]
    _, every = _rendered(tmp_path / "b", CHATML, [dict(m) for m in TWO_TURNS], train_on="all", eos="<|im_end|>")
    assert every.mask.all()


def test_row_problems_are_named(tmp_path):
    d = make_chat_tokenizer(tmp_path / "tok", CHATML)
    tpl = load_template(str(d), None)
    from loom.data.prepare.encoding import load_backend

    tok = load_backend(str(d))[0]
    with pytest.raises(RowError, match="role 'robot'"):
        conversation({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages")
    with pytest.raises(RowError, match="list content"):
        conversation({"messages": [{"role": "user", "content": ["a"]}]}, "messages", "messages")
    with pytest.raises(RowError, match="no 'messages'"):
        conversation({"text": "x"}, "messages", "messages")
    with pytest.raises(RowError, match="no assistant"):
        render(tpl, tok, [{"role": "user", "content": "x"}], None, "assistant")
    rewriting = load_template(str(make_chat_tokenizer(tmp_path / "rw", REWRITING)), None)
    with pytest.raises(RowError, match="not a prefix"):
        render(rewriting, tok, [dict(m) for m in TWO_TURNS], None, "assistant")
    msgs, _ = conversation({"prompt": "p", "completion": "c"}, "prompt_completion", "messages")
    assert [m["role"] for m in msgs] == ["user", "assistant"]


def _chat_args(tmp_path, template=CHATML, rows=None, n=40) -> list[str]:
    tok = make_chat_tokenizer(tmp_path / "tok", template, eos="<|im_end|>")
    data = write_chats(tmp_path / "chats.jsonl", n, rows)
    return ["dataset=chat", f"dataset.path={data}", f"dataset.tokenizer={tok}", "model=llama_tiny",
            "strategy=single", "dataset.seq_len=64", f"dataset.cache_dir={tmp_path / 'cache'}"]


def test_bad_rows_refused_before_anything_is_written(tmp_path):
    rows = [CONVERSATIONS[1], {"messages": [{"role": "user", "content": 3}]}, {"text": "no messages"},
            {"messages": [{"role": "user", "content": "only a question"}]}]
    err = refused(tmp_path, *_chat_args(tmp_path, rows=rows))
    assert "3 of 4 rows cannot be trained" in err
    assert "row 1:" in err and "row 2:" in err and "row 3:" in err and "row 0:" not in err


def test_template_problems_refused(tmp_path):
    err = refused(tmp_path, *_chat_args(tmp_path, template=None))
    assert "has no chat template" in err and "dataset.chat_template" in err
    err = refused(tmp_path / "b", *_chat_args(tmp_path / "b"), "dataset.chat_template=/nonexistent.jinja")
    assert "not a file" in err
    err = refused(tmp_path / "c", *_chat_args(tmp_path / "c"), "dataset.train_on=everything")
    assert "dataset.train_on" in err and "assistant, all, last" in err


# ---------------------------------------------------------------- the loss over the global batch
def _chat_sets(tmp_path, n: int = 8, seq_len: int = 256):
    """(padded, documents-packed) training samples of `n` conversations, rendered by the front end."""
    from omegaconf import OmegaConf

    from loom.data.options.chat.build import stores
    from loom.data.options.chat.samples import ChatSamples

    tok = make_chat_tokenizer(tmp_path / "tok", CHATML, eos="<|im_end|>")
    ds = OmegaConf.merge(OmegaConf.load("conf/dataset/chat.yaml"), {
        "path": str(write_chats(tmp_path / "chats.jsonl", n)), "tokenizer": str(tok), "val_every": 0,
        "seq_len": seq_len, "cache_dir": str(tmp_path / "cache")})
    dirs = stores(OmegaConf.create({"dataset": ds}))
    return (ChatSamples(dirs["train"], "chat", seq_len, "padded", "truncate"),
            ChatSamples(dirs["train"], "chat", seq_len, "documents", "truncate"))


def _model(vocab: int):
    import torch
    from omegaconf import OmegaConf

    from loom.models.lit import network_kwargs
    from loom.models.llama.network import Llama

    torch.manual_seed(0)
    m = OmegaConf.load("conf/model/llama_tiny.yaml")
    m.vocab_size, m.block_size = vocab, 256
    return Llama(**network_kwargs(m)).double()


def _step(model, dataset, dp: int, micro: int, global_batch: int, naive: bool = False):
    """One optimizer step's (logged loss, gradients) as DDP/FSDP and Lightning compute them: each
    rank sums its micro batches' loss / accumulation, the ranks' gradients are averaged; the
    logged loss is the mean over micro batches and ranks (tracking.recorder)."""
    import torch

    from loom.data.batch import collate
    from loom.data.sampler import ResumableDistributedSampler
    from loom.models.lit import _global_token_loss

    accum = global_batch // (micro * dp)
    grads, losses = None, []
    for rank in range(dp):
        model.zero_grad()
        sampler = ResumableDistributedSampler(dataset, dp, rank, micro_batch=micro, global_batch=global_batch,
                                              shuffle=False)
        items = list(sampler)[:micro * accum]
        for k in range(accum):
            batch = collate([dataset[it] for it in items[k * micro:(k + 1) * micro]])
            if naive:
                batch.loss_scale = torch.full_like(batch.loss_scale, float("nan"))  # the micro batch's own mean
            logits = model(batch.inputs, batch.positions)
            loss = _global_token_loss(logits, batch)
            (loss / accum).backward()
            losses.append(float(loss.detach()))
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) / dp
        grads = g if grads is None else grads + g
    return float(np.mean(losses)), grads


def test_loss_is_the_global_token_mean_whatever_the_layout(tmp_path):
    """Padded vs packed, 1 vs 2 ranks, accumulation 1 vs 4: the same loss and gradients (the loss
    is computed in float32: to 1e-6), where a per-micro-batch mean differs by 1e-2."""
    import torch

    padded, packed = _chat_sets(tmp_path)
    assert len(padded) == 8 and 1 < len(packed) < 8  # packing put several conversations in a row
    vocab = int(max(padded.store.read(0, padded.store.n_tokens).max(), 0)) + 1
    model = _model(max(vocab, 512))
    ids = np.arange(len(padded))
    trained = int(padded.trained_tokens(ids).sum())
    assert trained == int(packed.trained_tokens(np.arange(len(packed))).sum())
    ref_loss, ref_grad = _step(model, padded, dp=1, micro=8, global_batch=8)
    for dp, micro in ((1, 2), (2, 1), (2, 2), (1, 1)):
        loss, grad = _step(model, padded, dp=dp, micro=micro, global_batch=8)
        assert loss == pytest.approx(ref_loss, rel=1e-6), (dp, micro)
        assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-8), (dp, micro)
    loss, grad = _step(model, packed, dp=1, micro=len(packed), global_batch=len(packed))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
    naive, _ = _step(model, padded, dp=1, micro=2, global_batch=8, naive=True)
    print(f'global token mean {ref_loss:.6f}; per-micro-batch mean {naive:.6f}')
    assert abs(naive - ref_loss) > 1e-3  # what a per-micro-batch mean would have trained on


def test_hf_refuses_messages_as_text(tmp_path):
    """The silent failure this option replaces: dataset=hf on a messages column trained the list's repr."""
    data = write_chats(tmp_path / "chats.jsonl", 4)
    err = refused(tmp_path, "dataset=hf", f"dataset.path={data}", "dataset.text_column=messages",
                  "strategy=single")
    assert "dataset.text_column='messages'" in err and "dataset=chat" in err


def test_template_from_tokenizer_config_and_tool_turns_kept(tmp_path):
    """A template in tokenizer_config.json (the named-list form: `default`), and tool calls and tool
    results reach the template (rendered, masked as prompt except the assistant's own turn)."""
    import json

    tool_tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments | tojson }})"
                "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    d = make_chat_tokenizer(tmp_path / "tok", None, eos="<|im_end|>")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": tool_tpl}, {"name": "rag", "template": "x"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from loom.data.prepare.encoding import load_backend

    tpl = load_template(str(d), None)
    assert tpl.text == tool_tpl and tpl.special["eos_token"] == "<|im_end|>"
    messages, _ = conversation({"messages": [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "It is 5."}]}, "messages", "messages")
    tok = load_backend(str(d))[0]
    from transformers import AutoTokenizer

    r = render(tpl, tok, messages, None, "assistant")
    hf = AutoTokenizer.from_pretrained(str(d))
    assert _runs(hf, r) == ['add({"a": 2, "b": 3})<|im_end|>\n', "It is 5.<|im_end|>\n"]


def test_overlong_conversations_truncated_or_dropped_and_counted(tmp_path):
    """seq_len 80: of 8 conversations of 94, 65 or 98 tokens, 5 do not fit seq_len+1."""
    from loom.data.options.chat.build import CONVERSATIONS
    from loom.data.options.chat.samples import ChatSamples

    padded, _ = _chat_sets(tmp_path, seq_len=80)
    d = Path(padded.store.path).parent
    raw = np.load(d / CONVERSATIONS)  # offset, length, trained targets as rendered
    lengths = raw[:, 1].tolist()
    cut = ChatSamples(d, "chat", 80, "padded", "truncate")
    dropped = ChatSamples(d, "chat", 80, "padded", "drop")
    assert sorted(set(lengths)) == [65, 94, 98]
    long = sum(n > 81 for n in lengths)
    assert cut.overlong == dropped.overlong == long and len(cut) == 8 and len(dropped) == 8 - long
    assert all(cut[i].inputs.shape == (80,) for i in range(len(cut)))
    kept = raw[:, 1] <= 81
    assert (cut.conv[kept, 2] == raw[kept, 2]).all() and (cut.conv[~kept, 2] < raw[~kept, 2]).all()
    for i in range(len(cut)):  # the trained targets counted are the ones the sample trains
        assert int(cut[i].trained_targets()) == int(cut.trained_tokens(np.array([i]))[0])
    assert f"{long} longer than seq_len+1 truncated" in cut.describe(0)
    assert f"{long} longer than seq_len+1 dropped" in dropped.describe(0)


def test_a_template_that_does_not_render_is_refused(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    err = refused(tmp_path, *_chat_args(tmp_path), f"dataset.chat_template={bad}")
    assert "dataset.chat_template" in err and "does not render" in err


# ---------------------------------------------------------------- what cannot train is refused (issue 50)
def _cache_entries(tmp_path) -> list[str]:
    """Loom's entries in the cache (`hf/` beside them is the datasets library's own arrow copy of the source)."""
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir() if p.name != "hf") if cache.is_dir() else []


def test_a_refused_render_leaves_nothing_in_the_cache(tmp_path):
    """An unknown role refuses the render ("nothing was written"): no store skeleton is left behind."""
    rows = [CONVERSATIONS[1], {"messages": [{"role": "robot", "content": "beep"}]}]
    err = refused(tmp_path, *_chat_args(tmp_path, rows=rows))
    assert "row 1: message 0 has role 'robot'" in err and "nothing was written" in err
    assert _cache_entries(tmp_path) == [], _cache_entries(tmp_path)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_a_malformed_row_of_any_data_file_is_one_paragraph_naming_it(tmp_path, kind):
    """A line that is not JSON, a CSV record with a field too many, a damaged parquet file: exit 2 with
    one paragraph naming the file, the row and the parser's words (was an 89-line pyarrow traceback),
    and nothing in the cache."""
    import json

    good = {"prompt": "the quick brown fox", "completion": "jumps over the lazy dog"}
    data = tmp_path / f"pairs.{kind}"
    if kind == "jsonl":
        data.write_text(json.dumps(good) + "\n" + '{"prompt": "a", "completion": }\n' + json.dumps(good) + "\n")
        where = f"{data} line 2 is not JSON (Expecting value at column 31"
    elif kind == "csv":
        data.write_text("prompt,completion\nthe quick brown fox,jumps\na,b,c\n")
        where = f"{data} record at line 3 has 3 fields where the header has 2"
    else:
        data.write_bytes(b"PAR1" + b"\x00garbage" * 20)
        where = f"{data} is not a readable parquet file"
    args = [a for a in _chat_args(tmp_path) if not a.startswith("dataset.path=")]
    err = refused(tmp_path, *args, f"dataset.path={data}", "dataset.format=prompt_completion")
    assert where in err and "nothing was written" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert _cache_entries(tmp_path) == [], _cache_entries(tmp_path)


def test_empty_assistant_replies_are_dropped_and_counted_or_refused(tmp_path):
    """dataset.empty_replies=drop (default): the row is left out and counted in the dataset line;
    =refuse names it. A reply of whitespace is empty; an assistant turn that calls a tool is not."""
    from omegaconf import OmegaConf

    from loom.data.options.chat.build import stores
    from loom.data.options.chat.samples import ChatSamples

    empty = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}
    rows = [CONVERSATIONS[1], empty, CONVERSATIONS[2]]
    err = refused(tmp_path / "r", *_chat_args(tmp_path / "r", rows=rows), "dataset.empty_replies=refuse")
    assert "1 of 3 rows cannot be trained" in err and "row 1: message 1 (assistant) is empty" in err, err
    tok = make_chat_tokenizer(tmp_path / "tok", CHATML, eos="<|im_end|>")
    ds = OmegaConf.merge(OmegaConf.load("conf/dataset/chat.yaml"), {
        "path": str(write_chats(tmp_path / "chats.jsonl", 3, rows)), "tokenizer": str(tok), "val_every": 0,
        "seq_len": 256, "cache_dir": str(tmp_path / "cache")})
    train = ChatSamples(stores(OmegaConf.create({"dataset": ds}))["train"], "chat", 256, "padded", "truncate")
    assert len(train) == 2 and "; 1 with an empty assistant reply dropped ->" in train.describe(0), train.describe(0)
    err = refused(tmp_path / "e", *_chat_args(tmp_path / "e", rows=[empty, empty]))
    assert "no conversation to train on: 2 rows (2 with an empty assistant reply dropped)" in err, err


def test_a_dataset_with_nothing_to_train_at_seq_len_is_refused_with_counts(tmp_path):
    """Every prompt longer than seq_len: truncated, no reply token is left in any row. Was a run at
    loss 0.0000 that completed; now exit 2 before launch, counted per reason. With drop, the same."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
    rows = [{"messages": [{"role": "user", "content": f"{long} {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(4)]
    err = refused(tmp_path, *_chat_args(tmp_path, rows=rows), "dataset.val_every=0")
    assert "dataset.seq_len=64" in err and "no conversation of the 4 in the train split" in err, err
    assert "4 longer than seq_len+1 truncated; 4 with no trained token within seq_len+1 dropped" in err, err
    err = refused(tmp_path / "d", *_chat_args(tmp_path / "d", rows=rows), "dataset.val_every=0",
                  "dataset.overlong=drop")
    assert "(4 longer than seq_len+1 dropped)" in err and "dataset.overlong=truncate" in err, err
    mixed = [*rows[:3], CONVERSATIONS[1]]  # one conversation trains: accepted, the rest counted
    from loom import cli

    args = [*_chat_args(tmp_path / "m", rows=mixed), "dataset.val_every=0", f"run.root={tmp_path / 'm'}"]
    assert cli.main(["plan", *args]) == 0
