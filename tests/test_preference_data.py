"""dataset=preference: pairs rendered exactly as transformers' `apply_chat_template` renders prompt +
completion (three row layouts, TRL's implicit-prompt split as the oracle), the trained targets exactly
the completion's, the overlong rule and its counts, identical sides, bad rows refused before anything
is written, and the samples' `Batch(pairs=True)` through a DataLoader and the DataModule. In process,
no launch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from chat_helpers import CHATML, MISTRAL, REWRITING, make_chat_tokenizer
from conftest import ROOT, refused

from loom.data.batch import IGNORE_INDEX

SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE, GREEN = "It is blue.", "It is green, I think."
SYSTEM = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "How are you?"}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _rows(layout: str, n: int) -> list[dict]:
    """`n` rows of one layout, varied by index (every 2nd with a multi-turn system prompt)."""
    out = []
    for i in range(n):
        prompt = [dict(m) for m in (SYSTEM if i % 2 else SKY)]
        prompt[-1]["content"] += f" {i}"
        chosen, rejected = f"{BLUE} {i}", f"{GREEN} {i}"
        if layout == "messages":
            out.append({"prompt": prompt, "chosen": _assistant(chosen), "rejected": _assistant(rejected)})
        elif layout == "implicit":
            out.append({"chosen": prompt + _assistant(chosen), "rejected": prompt + _assistant(rejected)})
        else:  # strings: one user message, one assistant message
            out.append({"prompt": prompt[-1]["content"], "chosen": chosen, "rejected": rejected})
    return out


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokenizer(tmp_path: Path, template: str | None = CHATML) -> Path:
    d = tmp_path / "tok"
    return d if d.is_dir() else make_chat_tokenizer(d, template, eos="<|im_end|>")


def _cfg(tmp_path: Path, rows: list[dict], **kw):
    from omegaconf import OmegaConf

    ds = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "dataset" / "preference.yaml"), {
        "path": str(_write(tmp_path / "pairs.jsonl", rows)), "tokenizer": str(_tokenizer(tmp_path)),
        "val_every": 0, "seq_len": 256, "cache_dir": str(tmp_path / "cache"), **kw})
    return OmegaConf.create({"dataset": ds})


def _samples(tmp_path: Path, rows: list[dict], seq_len: int = 256, overlong: str = "truncate", **kw):
    from loom.data.options.preference.build import stores
    from loom.data.options.preference.samples import PreferenceSamples

    dirs = stores(_cfg(tmp_path, rows, **kw))
    return PreferenceSamples(dirs["train"], "preference", seq_len, overlong)


def _ids(hf, messages: list[dict], gen: bool = False) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    return list(out if isinstance(out, list) else out["input_ids"])


def _expected(hf, row: dict) -> tuple[list[int], list[int], int]:
    """(prompt+chosen ids, prompt+rejected ids, where the completion starts) by transformers, with
    TRL's implicit-prompt split and its rule for where the completion starts."""
    from trl.data_utils import extract_prompt

    if "prompt" not in row:
        row = extract_prompt(row)
    if isinstance(row["prompt"], str):
        row = {"prompt": [{"role": "user", "content": row["prompt"]}], "chosen": _assistant(row["chosen"]),
               "rejected": _assistant(row["rejected"])}
    head = _ids(hf, row["prompt"], gen=True)
    sides = [_ids(hf, row["prompt"] + row[s]) for s in ("chosen", "rejected")]
    common = [next((k for k, (a, b) in enumerate(zip(head, s, strict=False)) if a != b), min(len(head), len(s)))
              for s in sides]
    return sides[0], sides[1], min(common)


@pytest.mark.parametrize("layout", ["messages", "implicit", "strings"])
def test_pairs_render_as_apply_chat_template_and_train_only_the_completion(tmp_path, layout):
    from transformers import AutoTokenizer

    rows = _rows(layout, 6)
    train = _samples(tmp_path, rows)
    hf = AutoTokenizer.from_pretrained(str(_tokenizer(tmp_path)))
    assert len(train) == 6
    for i, row in enumerate(rows):
        chosen, rejected, start = _expected(hf, row)
        b = train[i]
        assert b.pairs and b.masked and b.inputs.shape == b.targets.shape == (2, 256)
        for side, ids, completion in ((0, chosen, f"{BLUE} {i}"), (1, rejected, f"{GREEN} {i}")):
            n = len(ids)
            assert b.inputs[side, :n].tolist() == ids and not b.inputs[side, n:].any()  # then padding
            lab = b.targets[side]
            assert lab[:start - 1].eq(IGNORE_INDEX).all() and lab[n - 1:].eq(IGNORE_INDEX).all()  # prompt, padding
            assert lab[start - 1:n - 1].tolist() == ids[start:]  # every completion token, nothing else
            assert hf.decode(ids[start:]) == f"{completion}<|im_end|>\n"
        assert b.reference.shape == (2,) and b.reference.isnan().all()
    assert (train.fitted.trained().sum(axis=1) > 0).all()


def test_overlong_pairs_truncated_prompt_first_or_dropped_and_counted(tmp_path):
    """seq_len 80: a long prompt is cut from its start on both sides (its last tokens kept) until the
    longer side fits; a completion too long alone is cut at its end; drop drops both kinds."""
    from transformers import AutoTokenizer

    from loom.data.options.preference.samples import PreferenceSamples

    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
    rows = [{"prompt": "Hi", "chosen": BLUE, "rejected": GREEN},                     # fits
            {"prompt": long_prompt, "chosen": BLUE, "rejected": GREEN},              # the prompt is cut
            {"prompt": "Hi", "chosen": " ".join([long_prompt] * 3), "rejected": GREEN}]  # a completion too
    cut = _samples(tmp_path, rows, seq_len=80)
    hf = AutoTokenizer.from_pretrained(str(_tokenizer(tmp_path)))
    full = [_expected(hf, r) for r in rows]
    assert max(len(full[0][0]), len(full[0][1])) <= 81 < min(len(full[1][0]), len(full[2][0]))
    assert len(full[2][0]) - full[2][2] > 81  # the chosen completion alone does not fit
    assert len(cut) == 3 and "2 longer than seq_len+1 truncated (1 with a completion cut)" in cut.describe(0)
    chosen, rejected, start = full[1]
    k = max(len(chosen), len(rejected)) - 81  # tokens cut from the prompt's start, the same on both sides
    assert 0 < k < start
    b = cut[1]
    for side, ids in ((0, chosen), (1, rejected)):
        kept = ids[k:]
        assert len(kept) <= 81 and b.inputs[side, :len(kept) - 1].tolist() == kept[:-1]
        assert b.targets[side][b.targets[side] != IGNORE_INDEX].tolist() == ids[start:]  # the completion, whole
    b = cut[2]  # the prompt kept to its last token, the chosen completion cut at its end
    chosen, _, start = full[2]
    assert b.inputs[0].tolist() == chosen[start - 1:start + 79]
    assert (b.targets[0] != IGNORE_INDEX).sum() == 80 and cut.fitted.trained()[2, 0] == 80
    assert b.targets[0].tolist() == chosen[start:start + 80]
    dropped = PreferenceSamples(cut.split_dir, "preference", 80, "drop")
    assert len(dropped) == 1 and "2 longer than seq_len+1 dropped" in dropped.describe(0)
    assert dropped.fit_key != cut.fit_key != PreferenceSamples(cut.split_dir, "preference", 81, "truncate").fit_key
    assert cut.fit_key == PreferenceSamples(cut.split_dir, "preference", 80, "truncate").fit_key


def test_the_overlong_rule_on_counts():
    """fit_pairs alone: the cut keeps one prompt token; pairs that fit are untouched."""
    from loom.data.options.preference.fit import LEN_C, LEN_R, OFF_C, OFF_R, PROMPT, fit_pairs

    pairs = np.array([[0, 10, 10, 8, 5, 0],      # fits seq_len+1 = 11
                      [18, 20, 38, 14, 12, 1],   # longer side 20: the prompt loses 9 of 12
                      [52, 30, 82, 6, 4, 2]],    # the prompt loses 3 (keeps 1), chosen still 27: cut to 11
                     dtype=np.int64)
    out = fit_pairs(pairs, 10, "truncate")
    assert out.pairs[0].tolist() == pairs[0].tolist()
    assert out.pairs[1, [OFF_C, LEN_C, OFF_R, LEN_R, PROMPT]].tolist() == [27, 11, 47, 5, 3]
    assert out.pairs[2, [OFF_C, LEN_C, OFF_R, LEN_R, PROMPT]].tolist() == [55, 11, 85, 3, 1]
    assert out.trained().tolist() == [[5, 3], [8, 2], [10, 2]]
    assert (out.overlong, out.completion_cut) == (2, 1)
    assert fit_pairs(pairs, 10, "drop").pairs.tolist() == pairs[:1].tolist()


def test_identical_sides_warned_and_counted_or_refused(tmp_path, caplog):
    rows = _rows("messages", 4)
    rows[2]["rejected"] = rows[2]["chosen"]
    with caplog.at_level(logging.WARNING, logger="loom"):
        train = _samples(tmp_path, rows)
    assert len(train) == 3 and "; 1 with identical chosen and rejected dropped ->" in train.describe(0)
    assert "1 of 4 rows with identical chosen and rejected dropped (rows 2;" in caplog.text, caplog.text
    err = refused(tmp_path / "r", *_args(tmp_path / "r", rows), "dataset.identical=refuse")
    assert "1 of 4 rows cannot be trained" in err and "row 2: its 'chosen' and 'rejected' are identical" in err, err
    same = [{"prompt": "Hi", "chosen": "x", "rejected": "x"}] * 2
    err = refused(tmp_path / "e", *_args(tmp_path / "e", same))
    assert "no pair to train on: 2 rows (2 with identical chosen and rejected dropped)" in err, err


def _args(tmp_path: Path, rows: list[dict], template: str | None = CHATML) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(tmp_path, template)
    data = _write(tmp_path / "pairs.jsonl", rows)
    return ["dataset=preference", f"dataset.path={data}", f"dataset.tokenizer={tok}", "model=llama_tiny",
            "strategy=single", "dataset.seq_len=64", "dataset.val_every=0", f"dataset.cache_dir={tmp_path / 'cache'}"]


def _cache_entries(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir() if p.name != "hf") if cache.is_dir() else []


def test_bad_rows_refused_naming_them_before_anything_is_written(tmp_path):
    good = {"prompt": "Hi", "chosen": BLUE, "rejected": GREEN}
    rows = [good, {"prompt": "Hi", "chosen": BLUE, "rejected": None},         # no rejected
            {"prompt": "Hi", "chosen": None, "rejected": GREEN},              # no chosen
            {"chosen": BLUE, "rejected": GREEN, "prompt": None},              # strings with no prompt
            {"prompt": "Hi", "chosen": BLUE, "rejected": GREEN}]
    err = refused(tmp_path, *_args(tmp_path, rows))
    assert "3 of 5 rows cannot be trained" in err and "nothing was written" in err, err
    assert "row 1: has no 'rejected'" in err and "row 2: has no 'chosen'" in err, err
    assert "row 3: has no prompt, so its 'chosen' and 'rejected' must be whole conversations" in err, err
    assert "row 0:" not in err and "row 4:" not in err and _cache_entries(tmp_path) == []
    roles = [{"prompt": [{"role": "robot", "content": "beep"}], "chosen": BLUE, "rejected": GREEN},
             {"prompt": "Hi", "chosen": [{"role": "user", "content": "x"}], "rejected": GREEN},
             {"chosen": SKY + _assistant(BLUE), "rejected": [{"role": "user", "content": "other"}]}]
    err = refused(tmp_path / "m", *_args(tmp_path / "m", roles))
    assert "row 0: 'prompt' message 0 has role 'robot'" in err, err
    assert "row 1: its 'chosen' completion starts with a user message" in err, err
    assert "row 2: its 'chosen' and 'rejected' differ at their first message" in err, err


@pytest.mark.parametrize("template, said", [
    (REWRITING, "is not a prefix of prompt + 'chosen'"),       # rewrites the prompt: no split derivable
    (MISTRAL, "does not render it"),                           # raise_exception: roles must alternate
])
def test_a_template_that_cannot_render_the_pair_is_refused_naming_the_row(tmp_path, template, said):
    rows = [{"prompt": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
             "chosen": BLUE, "rejected": GREEN}]
    err = refused(tmp_path, *_args(tmp_path, rows, template=template))
    assert "1 of 1 rows cannot be trained" in err and "row 0:" in err and said in err, err


def test_nothing_to_train_at_seq_len_is_refused_with_counts(tmp_path):
    rows = [{"prompt": "Hi", "chosen": " ".join(["the quick brown fox"] * 30), "rejected": GREEN}] * 2
    err = refused(tmp_path, *_args(tmp_path, rows), "dataset.overlong=drop")
    assert "dataset.seq_len=64" in err and "no pair of the 2 in the train split fits" in err, err
    assert "(2 longer than seq_len+1 dropped)" in err and "dataset.overlong=truncate" in err, err


def test_a_loader_stacks_pairs_and_the_datamodule_applies_no_token_scale(tmp_path):
    """collate: Batch(pairs=True) of (B, 2, T) with (B, 2) references; the DataModule's sampler hands
    plain ids (a pair objective's loss is a mean over pairs: chat's loss_scale must not apply), and
    the run counts 2 x seq_len tokens per sample (tokens/s, MFU)."""
    import torch
    from torch.utils.data import DataLoader

    from loom.data import is_pairs, items_per_sample
    from loom.data.batch import collate
    from loom.data.module import LoomDataModule
    from loom.models import model_spec
    from loom.pipeline import resolve

    args = _args(tmp_path, _rows("messages", 12))
    cfg = resolve([*args, "objective=dpo", "hardware=cpu", "hardware.devices=1", "hardware.dataloader_workers=0",
                   "dataset.batch_size=3", f"run.root={tmp_path}"])
    assert is_pairs(cfg.dataset) and items_per_sample(cfg) == model_spec(cfg).items_per_sample == 2 * 64
    chat = resolve(["dataset=chat", f"dataset.path={_chats(tmp_path)}", f"dataset.tokenizer={_tokenizer(tmp_path)}",
                    "model=llama_tiny", "dataset.seq_len=64", "hardware=cpu", "hardware.devices=1",
                    f"dataset.cache_dir={tmp_path / 'cache'}", f"run.root={tmp_path}"])
    assert model_spec(chat).flops_per_token == model_spec(cfg).flops_per_token  # attention spans one side
    dm = LoomDataModule(cfg, 0, 1)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch.pairs and batch.loss_scale is None and batch.inputs.shape == (3, 2, 64)
    assert batch.targets.shape == (3, 2, 64) and batch.reference.shape == (3, 2) and batch.reference.isnan().all()
    train = dm.train_set
    train.reference = np.arange(2 * len(train), dtype=np.float32).reshape(-1, 2)
    loaded = next(iter(DataLoader(train, batch_size=4, collate_fn=collate)))
    assert loaded.inputs.shape == (4, 2, 64) and loaded.inputs.dtype == torch.int64 and loaded.pairs
    assert loaded.reference.dtype == torch.float32 and loaded.reference.tolist() == train.reference[:4].tolist()
    assert train.split_dir.parent.name.startswith("preference-") and len(train.fit_key) == 16


def _chats(tmp_path: Path) -> Path:
    rows = [{"messages": SKY + _assistant(f"{BLUE} {i}")} for i in range(8)]
    return _write(tmp_path / "chats.jsonl", rows)
