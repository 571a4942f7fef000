"""`model=hf_causal_lm model.head=score`: a Bradley-Terry reward model (loom.models.heads): transformers'
`...ForSequenceClassification` (num_labels=1) whose base reads a causal LM's weights by name and whose score
head is drawn by the std rule; `sequence_scores` at each row's last real token; exported (whole, or LoRA
merged by peft) as a directory `AutoModelForSequenceClassification.from_pretrained` loads with the same
scores. In process: modules built as the worker builds them, exports through `loom export` (no launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_helpers import CHATML, CONVERSATIONS, make_chat_tokenizer, write_chats
from conftest import refused
from safetensors.torch import load_file
from test_export import _loom, _wrote
from test_preference_step import write_pairs

from loom.models import build_module
from loom.pipeline import resolve

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single", "hardware.dataloader_workers=0"]
LLAMA = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A chat tokenizer (eos <|im_end|>, no pad token) and conversations; a tiny Llama causal LM with its
    safetensors (the base), its config alone, a weightless GPT-2 config and a CodeGen config (an
    architecture transformers has no sequence classifier for)."""
    from transformers import CodeGenConfig, GPT2Config, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("reward")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.2)
    base.save_pretrained(d / "base")
    LlamaConfig(**LLAMA).save_pretrained(d / "llama")
    GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=400, n_positions=128).save_pretrained(d / "gpt2")
    CodeGenConfig(n_layer=1, n_head=2, n_embd=32, rotary_dim=8, vocab_size=400, n_positions=128).save_pretrained(d / "codegen")
    return {"root": d, "base": d / "base", "llama": d / "llama", "gpt2": d / "gpt2", "codegen": d / "codegen",
            "tok": make_chat_tokenizer(d / "tok", CHATML, eos="<|im_end|>"), "chats": write_chats(d / "chats.jsonl", 12),
            "pairs": write_pairs(d / "pairs.jsonl", 12)}


def _args(dirs, config: str, *more: str) -> list[str]:
    return ["model=hf_causal_lm", f"model.config={dirs[config]}", "model.head=score", "objective=reward",
            "dataset=preference", f"dataset.path={dirs['pairs']}", f"dataset.tokenizer={dirs['tok']}", "dataset.seq_len=64",
            f"dataset.cache_dir={dirs['root'] / 'cache'}", *ONE_CPU, *more]


def _module(dirs, config: str, *more: str):
    cfg = resolve(_args(dirs, config, *more))
    module = build_module(cfg)
    if cfg.model.init_from:
        module.init_source = cfg.model.init_from  # as the worker sets it (loom.worker.fit)
    module.configure_model()
    return cfg, module


def _drawn(name: str, shape: tuple[int, ...], seed: int, std: float = 0.02) -> torch.Tensor:
    from loom.models.init import NamedInit, std_rule

    return NamedInit(seed, std_rule(std)).full_value(name, shape, torch.device("cpu"))


def _conversation(dirs, i: int = 0) -> torch.Tensor:
    """A rendered conversation, unpadded: (1, T) token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["tok"])
    ids = tok.apply_chat_template(CONVERSATIONS[i]["messages"], tokenize=True, return_dict=False)
    return torch.tensor([list(ids)])


def _completion_targets(x: torch.Tensor, start: int) -> torch.Tensor:
    """Targets of a row whose completion runs from input `start` to its end: x[t + 1] for t in
    [start, T - 1), -100 elsewhere (so the last real token is the input's last)."""
    targets = torch.full_like(x, -100)
    targets[:, start:-1] = x[:, start + 1:]
    return targets


@pytest.mark.parametrize("how", ["model.config", "model.init_from"])
def test_the_score_head_is_drawn_and_the_base_reads_the_causal_lms_weights(dirs, how, caplog):
    """Mutations caught: the causal LM built (lm_head, no score); score.weight read from the file
    (KeyError) or left at zero; the base not read (random); the drawn head not seeded by name."""
    more = ("llama", f"model.init_from={dirs['base']}") if how == "model.init_from" else ("base",)
    with caplog.at_level("INFO", logger="loom"):
        cfg, module = _module(dirs, *more)
    said = [r.getMessage() for r in caplog.records if "model.head=score" in r.getMessage()]
    source = f"model.init_from={dirs['base']}" if how == "model.init_from" else f"model.config={dirs['base']}"
    assert len(said) == 1 and "score.weight drawn by the std rule" in said[0] and source in said[0], said
    model = module.model
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert not any("lm_head" in n for n, _ in model.named_parameters())
    assert torch.equal(model.score.weight.detach(), _drawn("score.weight", (1, 32), int(cfg.seed)))
    file = load_file(dirs["base"] / "model.safetensors")
    for name, p in model.named_parameters():
        if name != "score.weight":
            assert torch.equal(p.detach(), file[name]), name


def test_a_random_base_draws_the_head_by_the_same_rule(dirs):
    cfg, module = _module(dirs, "gpt2")
    assert type(module.model).__name__ == "GPT2ForSequenceClassification"
    assert torch.equal(module.model.score.weight.detach(), _drawn("score.weight", (1, 32), int(cfg.seed)))


def test_sequence_scores_on_padded_rows_equal_each_rows_unpadded_forward(dirs):
    """Rows of different lengths, right-padded with a token that is no pad (so transformers' pooling
    could not find the end): each row's score is its unpadded forward's score at its last token."""
    _, module = _module(dirs, "base")
    module.model.eval()
    rows = [_conversation(dirs, i)[0] for i in range(3)]
    T = max(len(r) for r in rows) + 3
    x = torch.full((3, T), 7)
    targets = torch.full((3, T), -100)
    for i, r in enumerate(rows):
        x[i, :len(r)] = r
        targets[i, :len(r)] = _completion_targets(r[None], len(r) // 2)[0]
    with torch.no_grad():
        got = module.sequence_scores(x, targets)
        want = torch.stack([module.token_scores(r[None])[0, -1] for r in rows])
    assert got.shape == (3,)
    assert (got - want).abs().max().item() < 1e-5, (got, want)
    assert len(set(got.tolist())) == 3


def test_the_last_real_token_is_just_after_the_last_target_clamped():
    from loom.models.hf.module import last_token

    targets = torch.full((4, 6), -100)
    targets[0, 1:3] = 5      # completion's last token is input 3
    targets[1, 2:6] = 5      # runs to the end: clamped to 5
    targets[2, 4] = 5        # one target
    assert last_token(targets).tolist() == [3, 5, 5, 0]


def test_scores_need_the_score_head(dirs):
    cfg = resolve(["model=hf_causal_lm", f"model.config={dirs['base']}", "dataset=synthetic", "dataset.seq_len=32",
                   "dataset.vocab_size=256", *ONE_CPU])
    module = build_module(cfg)
    module.configure_model()
    with pytest.raises(RuntimeError, match="model.head=score"):
        module.sequence_scores(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def _run_dir(root: Path, cfg, state: dict[str, torch.Tensor]) -> Path:
    """A killed run's directory as `loom train` leaves it: config.yaml and one checkpoint of `state`."""
    from loom.rundir.config_file import frozen_yaml

    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(frozen_yaml(cfg))
    torch.save({"state_dict": state, "global_step": 3}, run / "checkpoints" / "step-0000003.ckpt")
    return run


def _hf_scores(out: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(x).logits[:, 0]


def _loom_scores(module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module.sequence_scores(x, _completion_targets(x, 3))


def test_export_hf_is_a_sequence_classifier_with_the_same_scores(dirs, tmp_path):
    """`loom export --format hf` of a reward run: config.json names LlamaForSequenceClassification,
    num_labels 1, pad_token_id the tokenizer's eos; score.weight in the weights; transformers' logits on
    an unpadded conversation equal sequence_scores, and on right-padded rows too (its pooling finds the
    last token by pad_token_id)."""
    from transformers import AutoTokenizer

    cfg, module = _module(dirs, "base")
    torch.manual_seed(3)
    with torch.no_grad():
        module.model.score.weight.normal_(0.0, 0.5)
    module.model.eval()
    run = _run_dir(tmp_path, cfg, {f"model.{k}": v for k, v in module.model.state_dict().items()})
    rc, out, err = _loom("export", str(run), "--format", "hf")
    assert rc == 0, err
    exported = _wrote(out)
    config = json.loads((exported / "config.json").read_text())
    eos = AutoTokenizer.from_pretrained(dirs["tok"]).eos_token_id
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == eos
    assert "score.weight" in load_file(exported / "model.safetensors")
    x = _conversation(dirs)
    want = _loom_scores(module, x)
    assert (_hf_scores(exported, x) - want).abs().max().item() < 1e-5
    rows = [_conversation(dirs, i)[0] for i in range(3)]
    padded = torch.full((3, max(len(r) for r in rows)), eos)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    wants = torch.cat([_loom_scores(module, r[None]) for r in rows])
    assert (_hf_scores(exported, padded) - wants).abs().max().item() < 1e-5


def _final_adapter(run: Path, cfg, module) -> None:
    """final/ and summary.json as a completed single-process LoRA run writes them (loom.models.lora.export_adapter
    on Loom's own strategy base: each entry whole on rank 0)."""
    from types import SimpleNamespace

    from loom.models.lora import export_adapter
    from loom.strategies.base import LoomStrategy

    trainer = SimpleNamespace(strategy=LoomStrategy(), global_step=3, is_global_zero=True)
    assert export_adapter(run / "final", cfg, trainer, module, 0) == "final/"
    (run / "summary.json").write_text(json.dumps({"status": "completed", "global_step": 3, "final_weights": "final/"}))


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft asks transformers
def test_a_lora_reward_model_trains_and_exports_its_adapters_and_score_head(dirs, tmp_path):
    """LoRA: adapters and the score head train (requires_grad), the checkpoint holds both, `--format peft`
    saves score.weight as peft's modules_to_save (loaded by PeftModel on a sequence classifier) and
    `--format hf` merges the adapters into the base with the head: both score as Loom does."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from loom.models.lora import adapter_state

    cfg, module = _module(dirs, "llama", f"model.init_from={dirs['base']}", "model.lora.r=4", "model.lora.alpha=8")
    trained = sorted(n for n, p in module.model.named_parameters() if p.requires_grad)
    assert "score.weight" in trained and all(n == "score.weight" or ".lora_" in n for n in trained), trained
    torch.manual_seed(5)
    with torch.no_grad():
        for p in module.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.2)
    module.model.eval()
    state = adapter_state(module, module.state_dict())
    assert "model.score.weight" in state and len(state) == len(trained)
    run = _run_dir(tmp_path, cfg, state)
    x = _conversation(dirs)
    want = _loom_scores(module, x)

    _final_adapter(run, cfg, module)  # final/ as the worker writes it at the end of the run
    rc, out, err = _loom("export", str(run), "--format", "peft", "--step", "3")  # the checkpoint's
    assert rc == 0, err
    for adapter in (run / "final", _wrote(out)):
        assert "base_model.model.score.weight" in load_file(adapter / "adapter_model.safetensors")
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"], config
        base = AutoModelForSequenceClassification.from_pretrained(dirs["base"], num_labels=1, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
        with torch.no_grad():
            assert (peft_model(x).logits[:, 0] - want).abs().max().item() < 1e-5

    rc, out, err = _loom("export", str(run), "--format", "hf")  # final/'s, merged
    assert rc == 0 and "final (step 3)" in out, err
    merged = _wrote(out)
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert not any("lora" in k for k in load_file(merged / "model.safetensors"))
    assert (_hf_scores(merged, x) - want).abs().max().item() < 1e-5


SYNTHETIC = ["dataset=synthetic", "dataset.seq_len=32", "dataset.vocab_size=256"]


@pytest.mark.parametrize("args,named", [
    (["model.head=value"], "model.head='value': valid choices: lm:"),
    (["model.config={codegen}"], "transformers has no ForSequenceClassification class for model.config="),
    (["strategy=fsdp_tp", "strategy.tensor_parallel=2"], "strategy.tensor_parallel=2: model.head=score trains with"),
    (["strategy=nd", "strategy.tp=2"], "strategy.tp=2: model.head=score trains with data parallelism only"),
    (["strategy=pp", "strategy.pp=2"], "strategy.pp=2: model.head=score trains with data parallelism only"),
])
def test_what_a_reward_model_cannot_be_is_refused_before_launch(dirs, args, named):
    args = [a.format(codegen=dirs["codegen"]) for a in args]
    base = ["model=hf_causal_lm", f"model.config={dirs['base']}", "model.head=score", *SYNTHETIC, "hardware=cpu",
            "hardware.devices=2" if any(a.startswith("strategy=") for a in args) else "hardware.devices=1"]
    err = refused(dirs["root"], *base, *args)
    assert named in err, err


def _sharded_scores_rank(rank: int, dirs: dict, init: str, x: torch.Tensor, y: torch.Tensor, out: Path) -> None:
    """One of 2 gloo ranks: the reward model's layers and root sharded by strategy=fsdp's own
    `shard_roots` (the root resharded after forward too), its scores and the score head's whole
    gradient after backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.strategies.model_parallel import shard_roots

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        _, module = _module(dirs, "base")
        shard_roots([module.model], module.sharding_units, init_device_mesh("cpu", (2,)), True)  # fsdp's own
        scores = module.sequence_scores(x, y)
        scores.sum().backward()
        grad = module.model.score.weight.grad.full_tensor()
        if rank == 0:
            torch.save({"scores": scores.detach(), "grad": grad}, out)
    finally:
        dist.destroy_process_group()


def test_scores_and_the_head_gradient_under_fsdp2_on_two_ranks_equal_one_process(dirs, tmp_path):
    """The score head (1 x hidden) shards to nothing on rank 1: its gradient must still come back, from
    the hook FSDP2 puts on the module's output (the tapped scores alone never reach it)."""
    import torch.multiprocessing as mp

    x = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    y = torch.full((2, 12), -100)
    y[0, 4:9], y[1, 2:11] = x[0, 5:10], x[1, 3:12]
    _, module = _module(dirs, "base")
    want = module.sequence_scores(x, y)
    want.sum().backward()
    out = tmp_path / "rank0.pt"
    mp.spawn(_sharded_scores_rank, args=(dirs, f"file://{tmp_path / 'store'}", x, y, out), nprocs=2)
    got = torch.load(out)
    assert torch.allclose(got["scores"], want.detach(), atol=1e-5)
    assert torch.allclose(got["grad"], module.model.score.weight.grad, atol=1e-5)


def test_the_plan_counts_the_score_head_beside_the_adapters(dirs):
    """Under LoRA a reward model trains its adapters and its score head (hidden x 1): the plan's count
    is the module's own count of trainable parameters."""
    from loom.models import trainable_params

    cfg, module = _module(dirs, "base", "model.lora.r=4", "model.lora.alpha=8")
    assert trainable_params(cfg) == sum(p.numel() for p in module.model.parameters() if p.requires_grad)
