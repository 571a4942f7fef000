"""Issue 38's fine-tuning launches, real processes: `recipe=sft` on conversations (dataset=chat)
from a tiny pretrained Llama checkpoint made here (test_llama_runs' `LlamaForCausalLM`).

`full`: every weight trained, conversations packed whole (`packing=documents`) on 2 ddp ranks with
accumulation 2. Its first step's loss is checked against transformers' own LlamaForCausalLM on
the same checkpoint, each conversation of the first global batch run alone: the sum of the
trained tokens' cross-entropy over their count (seen: equal to 1e-8). A per-micro-batch mean (1e-4 off here), attention
across packed conversations, or a wrong mask would each move it.

`lora`: `model.lora.r=4` under fsdp on 2 ranks, one padded conversation per row, validated at the
end, checkpointed. Its first loss is the base model's (lora_B starts at zero), checked the same
way; its checkpoints and optimizer state hold the adapters alone (tests/lora_helpers.py), final/
is what peft loads, `loom export --format hf` merges it into the base with the logits of
`PeftModel`, and `loom generate` continues a prompt with it. Resume exactness and the frozen base's
bytes are tests/test_lora.py's, in-process.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_helpers import CHATML, make_chat_tokenizer, write_chats
from conftest import FAST, launching_fixture
from test_llama_runs import _hf_checkpoint

STEPS = 4
GLOBAL = {"full": 8, "lora": 4}  # rows per step: 2 ranks x micro batch 2 (x accumulation 2)


def _inputs(root: Path) -> dict[str, Path]:
    """The checkpoint, a tokenizer within its 320-id vocabulary, 80 conversations (once per session)."""
    d = root / "sft-inputs"
    if not d.is_dir():
        d.mkdir()
        _hf_checkpoint(d / "tiny-llama")
        make_chat_tokenizer(d / "tok", CHATML, eos="<|im_end|>", vocab_size=300)
        write_chats(d / "chats.jsonl", 80)
    return {"model": d / "tiny-llama", "tok": d / "tok", "data": d / "chats.jsonl", "cache": d / "cache"}


def sft_args(shared, name: str) -> tuple[str, ...]:
    i = _inputs(shared.root)
    common = [*FAST[1:], "hardware=cpu", "recipe=sft", f"model.init_from={i['model']}", f"dataset.path={i['data']}",
              f"dataset.tokenizer={i['tok']}", f"dataset.cache_dir={i['cache']}", f"trainer.max_steps={STEPS}",
              "dataset.seq_len=256", "trainer.log_every_n_steps=1"]
    runs = {"full": ["strategy=ddp", "hardware.devices=2", "dataset.batch_size=2", "trainer.accumulate_grad_batches=2",
                     "dataset.packing=documents", "dataset.val_every=0"],
            "lora": ["strategy=fsdp", "hardware.devices=2", "dataset.batch_size=2", "model.lora.r=4",
                     "model.lora.alpha=8", "dataset.val_every=10", "checkpoint.every_n_steps=2"]}
    return (*common, *runs[name])


@launching_fixture(scope="module")
def sft_runs(shared) -> dict:
    out = {name: shared.get(*sft_args(shared, name)) for name in GLOBAL}
    for name, r in out.items():
        assert r.rc == 0, (name, r.out[-3000:], r.err[-3000:])
    return out


def _reference_first_loss(run_dir: Path, rows_per_step: int) -> tuple[float, int]:
    """(the mean cross-entropy over the trained tokens of step 1's global batch, their count), by
    transformers' LlamaForCausalLM on each conversation of the batch alone."""
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from loom.data.options.chat.build import stores
    from loom.data.options.chat.samples import ChatSamples
    from loom.data.sampler import ResumableDistributedSampler

    cfg = OmegaConf.load(run_dir / "config.yaml")
    ds = cfg.dataset
    samples = ChatSamples(stores(cfg)["train"], "chat", ds.seq_len, ds.packing, ds.overlong)
    sampler = ResumableDistributedSampler(samples, 1, 0, micro_batch=rows_per_step, global_batch=rows_per_step,
                                          seed=cfg.seed)
    rows = [i for i, _ in list(sampler)[:rows_per_step]]
    model = LlamaForCausalLM.from_pretrained(str(cfg.model.init_from)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            for c in samples._conversations(row):
                off, n = (int(v) for v in samples.conv[c, :2])
                ids = torch.from_numpy(samples.store.read(off, n).astype(np.int64))
                trained = torch.from_numpy(samples.mask.read(off, n).astype(bool))[1:]
                logits = model(input_ids=ids[None]).logits[0, :-1].float()
                ce = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
                total += float(ce[trained].sum())
                count += int(trained.sum())
    return total / count, count


def test_full_sft_first_loss_is_the_global_token_mean(sft_runs):
    r = sft_runs["full"]
    said = re.search(r"dataset chat: .*?(\d[\d,]*) conversations, ([\d,]+) tokens: ([\d,]+) trained, ([\d,]+) masked", r.out)
    assert said, r.out[-3000:]
    assert 0 < int(said[3].replace(",", "")) < int(said[4].replace(",", ""))  # the prompts are masked
    expected, count = _reference_first_loss(r.run_dir, GLOBAL["full"])
    losses = r.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[1] == pytest.approx(expected, rel=1e-6), (losses[1], expected, count)  # seen: 1e-8
    s = r.summary()
    assert s["status"] == "completed" and s["world_size"] == 2
    # trained tokens beside processed ones (padding and prompts are processed, not trained): the run's
    # count is every trained target of its 4 global batches; tokens/s counts every position
    assert s["attempts"][-1]["trained_tokens"] == _trained_targets(r.run_dir, STEPS * GLOBAL["full"])
    assert 0 < s["throughput"]["trained_tokens_per_sec"] < s["throughput"]["overall"]["tokens_per_sec"], s["throughput"]
    rows = [row for row in r.metrics() if row.get("perf/trained_tokens_per_sec")]
    assert [int(row["step"]) for row in rows] == list(range(1, STEPS + 1))
    assert all(0 < float(row["perf/trained_tokens_per_sec"]) < float(row["perf/tokens_per_sec"]) for row in rows)


def _trained_targets(run_dir: Path, n_rows: int) -> int:
    """The trained targets of the first `n_rows` rows of the run's global order (the sampler's, at any dp)."""
    from omegaconf import OmegaConf

    from loom.data.options.chat.build import stores
    from loom.data.options.chat.samples import ChatSamples
    from loom.data.sampler import ResumableDistributedSampler

    cfg = OmegaConf.load(run_dir / "config.yaml")
    ds = cfg.dataset
    samples = ChatSamples(stores(cfg)["train"], "chat", ds.seq_len, ds.packing, ds.overlong)
    order = ResumableDistributedSampler(samples, 1, 0, micro_batch=n_rows, global_batch=n_rows, seed=cfg.seed)
    rows = np.asarray([i for i, _ in list(order)[:n_rows]])
    return int(samples.trained_tokens(rows).sum())


def test_lora_sft_under_fsdp_trains_the_adapters_alone(sft_runs, tmp_path):
    from lora_helpers import (
        assert_adapter_only_checkpoint,
        assert_optimizer_state_is_the_adapters,
        assert_peft_final,
    )
    from omegaconf import OmegaConf

    r = sft_runs["lora"]
    base = Path(OmegaConf.load(r.run_dir / "config.yaml").model.init_from)
    assert OmegaConf.load(r.run_dir / "config.yaml").optim.lr == pytest.approx(2e-4)  # the recipe's LoRA rate
    expected, _ = _reference_first_loss(r.run_dir, GLOBAL["lora"])
    assert r.losses()[1] == pytest.approx(expected, rel=1e-6)  # step 1 is the base model's (seen: 1e-8)
    assert r.summary()["validation"]["loss"] > 0
    assert_adapter_only_checkpoint(r.run_dir)
    assert_optimizer_state_is_the_adapters(r.run_dir)
    assert_peft_final(r.run_dir, base)


def test_lora_run_exports_merged_and_generates(sft_runs, tmp_path, capsys):
    """`loom export --format hf` of the LoRA run: peft's merge, with PeftModel's logits; `loom
    generate` on it (in this process: no launch)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loom import cli

    r = sft_runs["lora"]
    out = tmp_path / "merged"
    assert cli.main(["export", str(r.run_dir), "--format", "hf", "--out", str(out)]) == 0
    from omegaconf import OmegaConf

    base = str(OmegaConf.load(r.run_dir / "config.yaml").model.init_from)
    x = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(r.run_dir / "final"))
        want = peft(input_ids=x).logits
        got = AutoModelForCausalLM.from_pretrained(str(out))(input_ids=x).logits
        unmerged = AutoModelForCausalLM.from_pretrained(base)(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(unmerged, want, atol=1e-5)  # the adapter moved the logits
    capsys.readouterr()
    assert cli.main(["generate", str(r.run_dir), "--prompt", "Hello", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
