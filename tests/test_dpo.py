"""Issue 53's one launch: SFT -> DPO -> export -> generate, real processes. `recipe=dpo` starts from
test_sft.py's full fine-tune (exported as a Hugging Face directory, `model.init_from`; its tokenizer
renders the pairs), with
LoRA adapters under fsdp on 2 ranks and `objective.reference=precompute`: before the first step the two
ranks score every pair (round-robin, equal counts, gathered) and rank 0 stores the log-probs beside
the rendered data. Checked here: those stored values equal transformers' `LlamaForCausalLM` on the SFT
weights, pair by pair (the rank dealing and gather); step 1's loss is ln 2 (the policy is still its
reference); the loss falls and the margin grows; the figures are in metrics.csv, summary.json and
report.md; final/ is a peft adapter that `loom export` merges and `loom generate` talks with.
Losses against TRL are test_objectives.py's; the references' agreement test_preference_step.py's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST, launching_fixture
from test_preference_step import write_pairs
from test_sft import _inputs, sft_args

STEPS = 4


@launching_fixture(scope="module")
def dpo_run(shared):
    sft = shared.get(*sft_args(shared, "full"))
    assert sft.rc == 0, sft.out[-3000:]
    i = _inputs(shared.root)
    pairs = write_pairs(shared.root / "pairs.jsonl", 40)
    start = shared.root / "sft-hf"  # the SFT run's weights as a Hugging Face directory (in process: no launch)
    if not start.is_dir():
        _hf_copy(sft.run_dir, start)
    r = shared.get(*FAST[1:], "hardware=cpu", "recipe=dpo", f"model.init_from={start}",
                   f"dataset.path={pairs}", f"dataset.tokenizer={i['tok']}", f"dataset.cache_dir={i['cache']}",
                   "hardware.devices=2", "dataset.batch_size=2", "dataset.seq_len=64", "dataset.val_every=5",
                   "model.lora.r=4", "model.lora.alpha=8", "optim.lr=5e-3", "optim.warmup_ratio=0",
                   "objective.reference=precompute", f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=2")
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    return r, start


def _hf_copy(run_dir: Path, out: Path) -> Path:
    from loom import cli

    assert cli.main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    return out


def test_precomputed_reference_is_transformers_on_the_starting_weights(dpo_run, tmp_path):
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from loom.data.options.preference.samples import datasets
    from loom.objectives.reference import reference_path

    r, start = dpo_run
    said = r.summary()["objective"]
    assert said["name"] == "dpo" and said["reference"] == "precompute"
    assert said["reference_log_probs"] == {"train": "computed", "val": "computed"}
    cfg = OmegaConf.load(r.run_dir / "config.yaml")
    train, _ = datasets(cfg)
    stored = np.load(reference_path(train, cfg))
    assert stored.shape == (len(train), 2)
    model = LlamaForCausalLM.from_pretrained(str(start)).eval()
    with torch.no_grad():
        for i in range(len(train)):
            pair = train[i]
            logp = torch.log_softmax(model(input_ids=pair.inputs).logits.float(), -1)
            y = pair.targets
            mine = torch.where(y != -100, logp.gather(-1, y.clamp_min(0)[..., None])[..., 0], 0.0).sum(-1)
            assert mine.numpy() == pytest.approx(stored[i], abs=2e-4), i


def test_dpo_starts_at_ln_2_and_learns_the_preference(dpo_run):
    r, _ = dpo_run
    losses = r.losses()
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference at step 1
    assert losses[STEPS] < losses[1]
    rows = {int(m["step"]): m for m in r.metrics() if m.get("train/rewards/margin")}
    assert sorted(rows) == list(range(1, STEPS + 1))  # at the step each belongs to
    assert float(rows[STEPS]["train/rewards/margin"]) > 0
    s = r.summary()
    assert set(s["objective"]["last_step"]) == {"rewards/chosen", "rewards/rejected", "rewards/margin",
                                                "rewards/accuracy"}
    assert s["validation"]["rewards/margin"] > 0 and 0 <= s["validation"]["rewards/accuracy"] <= 1
    assert "pairs" in r.out and s["tokens"] == STEPS * 4 * 2 * 64  # both sequences of a pair counted
    from loom.report.runs import load_run, run_report

    assert "reference precompute" in run_report(load_run(r.run_dir)).read_text()


def test_the_dpo_adapter_exports_and_generates(dpo_run, tmp_path, capsys):
    from loom import cli

    r, _ = dpo_run
    assert (r.run_dir / "final" / "adapter_model.safetensors").is_file()
    merged = _hf_copy(r.run_dir, tmp_path / "dpo-hf")
    assert (merged / "config.json").is_file()
    capsys.readouterr()
    assert cli.main(["generate", str(r.run_dir), "--prompt", "Say something kind", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
