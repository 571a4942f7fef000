"""A pair objective's training step and its reference (loom.objectives.step), in process: the three
ways of having the reference give the same losses; at step 1, with the policy still the reference,
DPO's loss is ln 2; the precomputed log-probabilities are stored beside the data under the reference's
and the data's fingerprints, read back by a later run, and a resume without them is refused; the plan
counts each way's memory and FLOPs and recommends one. The losses against TRL are test_objectives.py's;
the distributed precompute (2 fsdp ranks) is test_dpo.py's launch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from chat_helpers import CHATML, make_chat_tokenizer
from conftest import refused
from lora_helpers import make_hf_llama

from loom.data.batch import collate
from loom.models import build_module
from loom.objectives.reference import reference_path
from loom.objectives.step import PairStep
from loom.pipeline import resolve
from loom.plan import make_plan

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single", "hardware.precision=32-true"]
LORA = ["model.lora.r=4", "model.lora.alpha=8"]


def write_pairs(path: Path, n: int) -> Path:
    """`n` preference rows (prompt, chosen, rejected as strings), varied by index."""
    rows = [{"prompt": f"Say something kind about number {i}.",
             "chosen": f"Number {i} is a fine number, and I like it.",
             "rejected": f"No. {i}" + " really" * (i % 3)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pairs")
    return {"base": make_hf_llama(d / "base"), "tok": make_chat_tokenizer(d / "tok", CHATML, eos="<|im_end|>",
                                                                         vocab_size=300),
            "data": write_pairs(d / "pairs.jsonl", 24), "cache": d / "cache"}


def _cfg(inputs: dict[str, Path], *extra: str):
    return resolve(["model=llama", f"model.init_from={inputs['base']}", *ONE_CPU, "dataset=preference",
                    f"dataset.path={inputs['data']}", f"dataset.tokenizer={inputs['tok']}",
                    f"dataset.cache_dir={inputs['cache']}", "dataset.seq_len=48", "dataset.batch_size=4",
                    "dataset.val_every=4", "objective=dpo", *extra])


def _module(cfg):
    """The module as the worker builds it: its PairStep handed over before configure_model."""
    module = build_module(cfg)
    module.init_source = cfg.model.init_from
    module.pair_step = PairStep(cfg)
    module.configure_model()
    return module


def _sets(cfg):
    from loom.data.module import LoomDataModule

    dm = LoomDataModule(cfg, 0, 1)
    dm.setup("fit")
    return dm


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def _nudge(module, seed: int = 1) -> None:
    """Move every trained weight a little, the same way for the same seed (the policy after some steps)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_online_precompute_and_adapters_references_agree(inputs):
    pre_cfg, on_cfg = _cfg(inputs, "objective.reference=precompute"), _cfg(inputs, "objective.reference=online")
    pre, on = _module(pre_cfg), _module(on_cfg)
    assert (pre.pair_step.mode, on.pair_step.mode) == ("precompute", "online")
    dm = _sets(pre_cfg)
    dm.train_set.reference = pre.pair_step._split_reference(pre, _trainer(), dm.train_set, "train")
    batch = collate([dm.train_set[i] for i in range(4)])
    assert batch.pairs and batch.inputs.shape == (4, 2, 48) and not batch.reference.isnan().any()
    with torch.no_grad():
        first = [float(m.pair_step.loss(m, batch)) for m in (pre, on)]
    assert first == pytest.approx([math.log(2)] * 2, abs=1e-6)  # step 1: the policy is the reference
    _nudge(pre), _nudge(on)
    with torch.no_grad():
        later = [float(m.pair_step.loss(m, batch)) for m in (pre, on)]
    assert later[0] == pytest.approx(later[1], abs=1e-6)
    assert abs(later[0] - math.log(2)) > 1e-3  # the nudge moved the policy away from its reference
    lora = _module(_cfg(inputs, *LORA))  # auto under LoRA: the base with the adapters off
    assert lora.pair_step.mode == "adapters"
    _nudge(lora)  # lora_B away from zero: the policy differs from the base
    x, y = batch.inputs.reshape(8, 48), batch.targets.reshape(8, 48)
    ref = lora.pair_step.reference_logps(lora, x, y).view(4, 2)
    assert torch.allclose(ref, batch.reference, atol=1e-5)  # the base's, as precomputed without LoRA
    with torch.no_grad():
        assert abs(float(lora.pair_step.loss(lora, batch)) - math.log(2)) > 1e-4


def test_precomputed_log_probs_are_stored_and_reused_and_a_resume_needs_them(inputs):
    cfg = _cfg(inputs, "objective.reference=precompute")
    module, dm = _module(cfg), _sets(cfg)
    path = reference_path(dm.train_set, cfg)
    path.unlink(missing_ok=True)
    values = module.pair_step._split_reference(module, _trainer(), dm.train_set, "train")
    assert path.is_file() and values.shape == (len(dm.train_set), 2) and (values < 0).all()
    import numpy as np

    assert np.array_equal(np.load(path), values)
    again = PairStep(cfg)
    assert np.array_equal(again._split_reference(module, _trainer(), dm.train_set, "train"), values)
    assert again.precomputed == {"train": "read"}
    other = _cfg(inputs, "objective.reference=precompute", "seed=7")  # another reference: another file
    assert reference_path(dm.train_set, other) != path
    path.unlink()
    trainer = _trainer()
    trainer.ckpt_path = str(path.parent / "last.ckpt")  # a resume: the policy is no longer the reference
    with pytest.raises(RuntimeError, match="resuming, but the reference log-probs"):
        again._split_reference(module, trainer, dm.train_set, "train")


def test_the_plan_counts_the_reference_and_recommends_one(inputs):
    on = make_plan(_cfg(inputs, "objective.reference=online", "strategy=fsdp", "hardware.devices=2"))
    pre = make_plan(_cfg(inputs, "objective.reference=precompute", "strategy=fsdp", "hardware.devices=2"))
    lora = make_plan(_cfg(inputs, *LORA))
    assert on.reference["mode"] == "online" and on.reference["bytes_per_device"] > 0
    assert on.reference["flops_per_step"] == pytest.approx(on.flops_per_step / 3)
    assert on.memory_per_device_bytes["params"] == pytest.approx(
        pre.memory_per_device_bytes["params"] + on.reference["bytes_per_device"])  # the copy is counted
    assert pre.reference["flops_per_step"] == 0 and pre.reference["bytes_per_device"] == 0
    assert lora.reference["mode"] == lora.reference["recommended"] == "adapters"


def _args(inputs: dict[str, Path]) -> list[str]:
    return ["hardware=cpu", "dataset=preference", f"dataset.path={inputs['data']}", f"dataset.tokenizer={inputs['tok']}",
            f"dataset.cache_dir={inputs['cache']}", "dataset.seq_len=48"]


def test_pairs_and_objectives_refuse_what_does_not_go_together(inputs, tmp_path):
    import shutil

    err = refused(tmp_path, *_args(inputs), f"model.init_from={inputs['base']}", "model=llama")  # objective=lm
    assert "yields preference pairs" in err and "objective=dpo" in err, err
    err = refused(tmp_path, *_args(inputs), "model=hf_causal_lm", f"model.config={inputs['base']}", "model.head=score",
                  "objective=dpo")
    assert "model.head=score gives one score per sequence" in err and "objective=reward" in err, err
    other = tmp_path / "other-base"  # a checkpoint whose own tokenizer is not the pairs'
    shutil.copytree(inputs["base"], other)
    make_chat_tokenizer(other, CHATML, eos="<|im_end|>", vocab_size=280)
    err = refused(tmp_path, *_args(inputs), "model=llama", f"model.init_from={other}", "objective=dpo")
    assert "differs from dataset.tokenizer" in err and str(other) in err, err
    ok = resolve([*_args(inputs), "model=llama", f"model.init_from={inputs['base']}", "objective=dpo", *LORA,
                  "objective.reference=online", "strategy=zero3"])  # under LoRA online is the base, adapters off
    assert ok.objective.reference == "online"


def test_a_reward_step_is_bradley_terry_on_the_score_head(inputs):
    """objective=reward: the step scores both sides with model.head=score's scalar head (each row's last
    completion token) and trains -log sigmoid(chosen - rejected); the score head gets gradients."""
    cfg = resolve(["model=hf_causal_lm", f"model.config={inputs['base']}", "model.head=score", *ONE_CPU,
                   "dataset=preference", f"dataset.path={inputs['data']}", f"dataset.tokenizer={inputs['tok']}",
                   f"dataset.cache_dir={inputs['cache']}", "dataset.seq_len=48", "dataset.batch_size=4",
                   "dataset.val_every=4", "objective=reward"])
    module = build_module(cfg)
    module.pair_step = PairStep(cfg)
    module.configure_model()
    assert module.pair_step.mode is None and module.pair_step.scores
    batch = collate([_sets(cfg).train_set[i] for i in range(4)])
    loss = module.pair_step.loss(module, batch)
    with torch.no_grad():
        s = module.sequence_scores(batch.inputs.reshape(8, 48), batch.targets.reshape(8, 48)).view(4, 2)
    want = -torch.nn.functional.logsigmoid(s[:, 0] - s[:, 1]).mean()
    assert float(loss) == pytest.approx(float(want), abs=1e-6)
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    assert "score.weight" in grads and float(grads["score.weight"].abs().sum()) > 0


def test_the_plan_counts_a_pair_as_two_rows_and_a_score_head_as_one_output(inputs):
    """Activations hold both sequences of a pair; a reward model's score head writes one value per
    token, not the vocabulary's logits."""
    common = ["model=hf_causal_lm", f"model.config={inputs['base']}", *ONE_CPU[:2], "dataset=preference",
              f"dataset.path={inputs['data']}", f"dataset.tokenizer={inputs['tok']}",
              f"dataset.cache_dir={inputs['cache']}", "dataset.seq_len=48", "dataset.batch_size=2"]
    lm = make_plan(resolve([*common, "objective=dpo"]))
    score = make_plan(resolve([*common, "objective=reward", "model.head=score"]))
    rows = 2 * 2  # dataset.batch_size pairs of two sequences
    assert lm.tokens_per_step == rows * 48
    logits = lm.memory_per_device_bytes["activations"] - score.memory_per_device_bytes["activations"]
    assert logits == pytest.approx(10 * rows * 48 * (300 - 1))  # ~10 bytes per logit at the loss: vocab -> 1
