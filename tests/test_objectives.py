"""The `objective` group: Loom's preference losses and their gradients against TRL 1.16 as the oracle
(in process, fp32, a tiny transformers Llama saved locally), DPO's ln 2 at policy == reference, and the
group's refusals (exit 2 naming the key). No training launch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from chat_helpers import make_chat_tokenizer
from conftest import refused
from omegaconf import OmegaConf

from loom.objectives.losses import PairTerms, pair_loss, sequence_logps

# Two pairs of token ids (prompt, chosen, rejected) of different lengths, so padding and the
# per-completion token counts matter; ids from 30 up stay clear of the tokenizer's special tokens.
PAIRS = [
    {"prompt_ids": [31, 32, 33], "chosen_ids": [34, 35, 36], "rejected_ids": [37, 38]},
    {"prompt_ids": [41, 42], "chosen_ids": [43], "rejected_ids": [44, 45, 46, 47]},
    {"prompt_ids": [51, 52, 53, 54], "chosen_ids": [55, 56], "rejected_ids": [57, 58, 59]},
]
TOL = {"atol": 1e-5, "rtol": 1e-5}


DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT")


@pytest.fixture(autouse=True)
def one_process_trainers(monkeypatch):
    """TRL's trainers build accelerate's state, which joins a process group when the environment names
    one (an earlier in-process run of the suite leaves LOCAL_RANK and MASTER_ADDR behind; the fresh-clone
    CI then failed later tests with "initialize the default process group twice"): none here, and no
    group or accelerate state left for the tests after."""
    import torch.distributed as dist

    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A byte-level BPE tokenizer and a tiny Llama (policy) saved with save_pretrained, loaded back
    from the directory; the reference is the same weights moved a little (so its log-probs differ)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("objectives")
    tok = AutoTokenizer.from_pretrained(str(make_chat_tokenizer(root / "tok", None)))
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(root / "policy")
    policy = AutoModelForCausalLM.from_pretrained(root / "policy", torch_dtype=torch.float32)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return {"root": root, "tok": tok, "config": config, "policy": policy, "reference": reference.eval()}


def loom_batch(pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs as Loom's Batch holds them (loom.data.batch): inputs and next-token targets (B, 2, T),
    [:, 0] chosen, [:, 1] rejected, right-padded; targets IGNORE_INDEX except the completion's tokens."""
    seqs = [(p["prompt_ids"], p[k]) for p in pairs for k in ("chosen_ids", "rejected_ids")]
    width = max(len(a) + len(b) for a, b in seqs)
    inputs = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for row, (prompt, completion) in enumerate(seqs):
        ids = prompt + completion
        inputs[row, :len(ids)] = torch.tensor(ids)
        targets[row, len(prompt) - 1:len(ids) - 1] = torch.tensor(completion)  # position t predicts t + 1
    return inputs.view(len(pairs), 2, width), targets.view(len(pairs), 2, width)


def loom_terms(model, pairs: list[dict], reference=None, zero_reference: bool = False) -> PairTerms:
    """PairTerms as a training step makes them: one forward of the (2B, T) rows (no attention mask:
    right padding is after every trained target), sequence_logps, split into chosen and rejected."""
    inputs, targets = loom_batch(pairs)
    b, _, t = inputs.shape
    logps, counts = sequence_logps(model(inputs.view(2 * b, t)).logits, targets.view(2 * b, t))
    logps, counts = logps.view(b, 2), counts.view(b, 2)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = sequence_logps(reference(inputs.view(2 * b, t)).logits, targets.view(2 * b, t))[0].view(b, 2)
    elif zero_reference:
        ref = torch.zeros(b, 2)
    return PairTerms(logps[:, 0], logps[:, 1], counts[:, 0], counts[:, 1],
                     None if ref is None else ref[:, 0], None if ref is None else ref[:, 1])


def grads_of(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same(loom_loss, loom_grads, trl_loss, trl_grads) -> None:
    torch.testing.assert_close(loom_loss.detach(), trl_loss.detach(), **TOL)
    assert loom_grads.keys() == trl_grads.keys() and len(trl_grads) > 10
    for name, g in trl_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(loom_grads[name], g, **TOL, msg=name)


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["Hi", "pack my"], "chosen": [" there", " box"], "rejected": [" no", " jugs"]})


def trl_dpo(tiny, tmp_path, **config):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, **config)
    trainer = DPOTrainer(model=tiny["policy"], ref_model=tiny["reference"], args=args, train_dataset=dataset(),
                         processing_class=tiny["tok"])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(PAIRS))
    return loss, grads_of(trainer.model, loss), trainer._metrics["train"]


@pytest.mark.parametrize(("name", "loss_type"), [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_losses_and_gradients_equal_trl_dpo_trainer(tiny, tmp_path, name, loss_type):
    """DPOTrainer._compute_loss on its own collated batch (loss_type sigmoid | ipo, a frozen reference
    model) against Loom's pair_loss on the same pairs in Loom's batch layout: loss, every parameter's
    gradient, and the rewards TRL logs."""
    trl_loss, trl_grads, logged = trl_dpo(tiny, tmp_path, beta=0.1, loss_type=[loss_type])
    cfg = OmegaConf.create({"name": name, "beta": 0.1, "reference": "online",
                            **({"label_smoothing": 0.0} if name == "dpo" else {})})
    loss, metrics = pair_loss(cfg, loom_terms(tiny["policy"], PAIRS, reference=tiny["reference"]))
    assert_same(loss, grads_of(tiny["policy"], loss), trl_loss, trl_grads)
    for ours, theirs in (("chosen", "chosen"), ("rejected", "rejected"), ("margin", "margins"),
                         ("accuracy", "accuracies")):
        assert metrics[f"rewards/{ours}"].item() == pytest.approx(logged[f"rewards/{theirs}"][-1], abs=1e-5)
    assert abs(loss.item() - math.log(2)) > 1e-4  # the reference differs: not the trivial value


def trl_cpo(tiny, tmp_path, **config):
    """CPOTrainer.compute_loss on its collator's batch of the same pairs (labels: the completion's ids)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, cpo_alpha=0.0,
                     remove_unused_columns=False, **config)
    trainer = CPOTrainer(model=tiny["policy"], args=args, train_dataset=dataset(), processing_class=tiny["tok"])
    features = []
    for p in PAIRS:
        row = {"prompt_input_ids": p["prompt_ids"], "prompt_attention_mask": [1] * len(p["prompt_ids"])}
        for k in ("chosen", "rejected"):
            ids = p["prompt_ids"] + p[f"{k}_ids"]
            row |= {f"{k}_input_ids": ids, f"{k}_attention_mask": [1] * len(ids),
                    f"{k}_labels": [-100] * len(p["prompt_ids"]) + p[f"{k}_ids"]}
        features.append(row)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(features))
    return loss, grads_of(trainer.model, loss)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_trainer_simpo(tiny, tmp_path, smoothing):
    """CPOTrainer loss_type=simpo (cpo_alpha=0: no NLL term) with simpo_gamma = objective.gamma."""
    trl_loss, trl_grads = trl_cpo(tiny, tmp_path, loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                                  label_smoothing=smoothing)
    cfg = OmegaConf.create({"name": "simpo", "beta": 2.0, "gamma": 0.5, "label_smoothing": smoothing})
    loss, _ = pair_loss(cfg, loom_terms(tiny["policy"], PAIRS))
    assert_same(loss, grads_of(tiny["policy"], loss), trl_loss, trl_grads)


def test_conservative_dpo_equals_trl_cpo_sigmoid_with_label_smoothing(tiny, tmp_path):
    """TRL 1.16's DPOTrainer has no conservative DPO ("robust" divides by 1 - 2e, "aot" sorts the
    batch); CPOTrainer's sigmoid with label_smoothing is -(1-e) logsig(b z) - e logsig(-b z) on
    z = pc - pr, which is Loom's dpo with a zero reference."""
    trl_loss, trl_grads = trl_cpo(tiny, tmp_path, loss_type="sigmoid", beta=0.1, label_smoothing=0.2)
    cfg = OmegaConf.create({"name": "dpo", "beta": 0.1, "label_smoothing": 0.2, "reference": "precompute"})
    loss, _ = pair_loss(cfg, loom_terms(tiny["policy"], PAIRS, zero_reference=True))
    assert_same(loss, grads_of(tiny["policy"], loss), trl_loss, trl_grads)


@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_loss_equals_trl_reward_trainer(tiny, tmp_path, center):
    """RewardTrainer.compute_loss of a ...ForSequenceClassification (num_labels=1) on its collated
    pairs, against Loom's reward loss on the same model's scores of the same rows."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    config = copy.deepcopy(tiny["config"])
    config.num_labels = 1
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", torch_dtype=torch.float32)
    rows = [{"chosen_ids": p["prompt_ids"] + p["chosen_ids"], "rejected_ids": p["prompt_ids"] + p["rejected_ids"]}
            for p in PAIRS]
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                        center_rewards_coefficient=center)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tiny["tok"])
    trainer.model.train()
    batch = trainer.data_collator(rows)
    trl_loss = trainer.compute_loss(trainer.model, dict(batch))
    trl_grads = grads_of(trainer.model, trl_loss)

    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    chosen, rejected = scores.chunk(2)
    ones = torch.ones_like(chosen)
    loss, metrics = pair_loss(OmegaConf.create({"name": "reward", "center_rewards_coefficient": center}),
                              PairTerms(chosen, rejected, ones, ones))
    assert_same(loss, grads_of(model, loss), trl_loss, trl_grads)
    assert metrics["rewards/margin"].item() == pytest.approx((chosen - rejected).mean().item(), abs=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_dpo_at_policy_equal_to_reference_is_ln_2(tiny, smoothing):
    """At step 1 the policy is its reference: every log-ratio is 0, so the loss is -logsig(0) = ln 2
    (with any label smoothing), the rewards 0 and no pair ranked right."""
    cfg = OmegaConf.create({"name": "dpo", "beta": 0.1, "label_smoothing": smoothing, "reference": "online"})
    loss, metrics = pair_loss(cfg, loom_terms(tiny["policy"], PAIRS, reference=copy.deepcopy(tiny["policy"])))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["rewards/margin"].item() == 0 and metrics["rewards/accuracy"].item() == 0
    assert loss.requires_grad and not any(m.requires_grad for m in metrics.values())  # metrics are detached


def test_sequence_logps_sums_the_trained_targets_over_the_used_vocabulary():
    """Padded vocabulary columns never enter the softmax (as models/lit.py's _lm_loss), and IGNORE_INDEX
    targets count for nothing."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 10)
    targets = torch.tensor([[1, -100, 3, -100], [-100, -100, -100, 2]])
    logps, counts = sequence_logps(logits, targets, used=6)
    expect = torch.log_softmax(logits[..., :6], -1)
    torch.testing.assert_close(logps, torch.stack([expect[0, 0, 1] + expect[0, 2, 3], expect[1, 3, 2]]))
    assert counts.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="reference"):
        pair_loss(OmegaConf.create({"name": "dpo", "beta": 0.1, "label_smoothing": 0.0, "reference": "auto"}),
                  PairTerms(logps, logps, counts, counts))


# --- the checks: each refusal exits 2 naming the key -------------------------------------------------

@pytest.mark.parametrize(("args", "named"), [
    (("objective=dpo", "objective.beta=0"), "objective.beta=0.0"),
    (("objective=ipo", "objective.beta=-1"), "objective.beta=-1.0"),
    (("objective=dpo", "objective.label_smoothing=0.5"), "objective.label_smoothing=0.5"),
    (("objective=simpo", "objective.label_smoothing=-0.1"), "objective.label_smoothing=-0.1"),
    (("objective=simpo", "objective.gamma=-1"), "objective.gamma=-1.0"),
    (("objective=dpo", "objective.reference=copy"), "objective.reference='copy'"),
    (("objective=reward",), "model.head=score"),
    (("objective=dpo", "strategy=fsdp_tp"), "strategy=fsdp_tp"),
    (("objective=simpo", "strategy=pp"), "strategy=pp"),
    (("objective=dpo", "objective.reference=online", "strategy=zero3"), "objective.reference=precompute"),
    (("objective=dpo",), "dataset=tinycode yields none"),
])
def test_the_checks_refuse_with_exit_2_naming_the_key(tmp_path, args, named):
    err = refused(tmp_path, "hardware=cpu", *args)
    assert named in err, err


def test_the_default_objective_keeps_every_run_id():
    """objective=lm is every run's default and leaves the run identity as it was before the group."""
    from loom.freeze import identity
    from loom.pipeline import resolve

    cfg = resolve(["hardware=cpu"])
    assert cfg.objective.name == "lm" and "objective" not in identity(cfg)


def test_reference_auto_is_the_base_under_lora_else_precompute():
    from loom.objectives import reference_of

    def run(name: str, reference: str, r: int) -> str | None:
        return reference_of(OmegaConf.create({"objective": {"name": name, "reference": reference},
                                              "model": {"lora": {"r": r}}}))

    assert run("dpo", "auto", 8) == "adapters" and run("ipo", "auto", 0) == "precompute"
    assert run("dpo", "online", 8) == "adapters"  # under LoRA the online reference is the base, adapters off
    assert run("dpo", "precompute", 8) == "precompute" and run("dpo", "online", 0) == "online"
    assert run("lm", "auto", 8) is None
