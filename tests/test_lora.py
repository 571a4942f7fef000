"""LoRA via peft (`model.lora`, loom.models.lora): adapters on the named Linears with the base frozen,
step 0 equal to the base model, only the adapters trained and holding optimizer state, adapter-only
checkpoints that resume exactly (strict for the adapter keys), final/ a peft adapter directory that
`PeftModel.from_pretrained` loads with Loom's logits, the plan's trainable count, and the refusals.
In-process only (a Lightning Trainer on strategy=single): no launch, no network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from conftest import refused
from lora_helpers import assert_adapter_only_checkpoint, make_hf_llama, peft_keys

from loom import strategies
from loom.data.batch import Batch, collate
from loom.models import build_module, lora
from loom.pipeline import resolve
from loom.plan import make_plan

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single"]
LORA = ["model.lora.r=4", "model.lora.alpha=8", "optim.warmup_steps=0", "optim.lr=0.02"]
STEPS = 4  # two epochs of two batches: a checkpoint after the first resumes at an epoch boundary


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("lora") / "base")


def _cfg(base: Path, *extra: str, model: str = "llama"):
    key = "model.init_from" if model == "llama" else "model.config"
    return resolve([f"model={model}", f"{key}={base}", *ONE_CPU, "dataset.seq_len=32", *extra])


def _module(cfg):
    """The run's module built as the worker builds it: model.init_from read on every build (a resume too)."""
    module = build_module(cfg)
    if cfg.model.get("init_from"):
        module.init_source = cfg.model.init_from
    module.configure_model()
    return module


def _batches() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33), generator=g)
    return torch.utils.data.DataLoader([Batch(t[:-1], t[1:]) for t in tokens], batch_size=2, collate_fn=collate)


class SaveAt(pl.Callback):
    """A checkpoint at an optimizer step boundary, as Loom's saver writes it (on_train_batch_end)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(str(self.path))


def _fit(cfg, module, root: Path, steps: int, ckpt: Path | None = None, save: Path | None = None) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategies.build_strategy(cfg, strategies.layout_of(cfg)),
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=str(root), callbacks=[SaveAt(STEPS // 2, save)] if save else [])
    trainer.fit(module, train_dataloaders=_batches(), ckpt_path=str(ckpt) if ckpt else None,
                weights_only=True if ckpt else None)
    return trainer


def _x() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """A LoRA llama trained STEPS steps, its parameters as they were before training, and its run
    dir with the checkpoint saved half way."""
    cfg = _cfg(base_dir, *LORA)
    module = _module(cfg)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    run = tmp_path_factory.mktemp("run")
    trainer = _fit(cfg, module, run, STEPS, save=run / "checkpoints" / f"step-{STEPS // 2:07d}.ckpt")
    return cfg, module, trainer, before, run


def test_adapters_wrap_the_named_linears_and_step_0_is_the_base(base_dir):
    from transformers import LlamaForCausalLM

    module = _module(_cfg(base_dir, *LORA))
    names = {n: p for n, p in module.model.named_parameters()}
    q = "model.layers.0.self_attn.q_proj"
    assert {f"{q}.base_layer.weight", f"{q}.lora_A.default.weight", f"{q}.lora_B.default.weight"} <= set(names)
    trainable = sorted(n for n, p in names.items() if p.requires_grad)
    assert trainable == sorted(n for n in names if lora.is_adapter(n))
    assert len(trainable) == 2 * 7 * 2  # A and B on q/k/v/o/gate/up/down of 2 layers
    assert tuple(names[f"{q}.lora_A.default.weight"].shape) == (4, 64)
    assert not names[f"{q}.lora_B.default.weight"].any()
    a = names[f"{q}.lora_A.default.weight"]
    assert a.abs().max() <= 1 / 64 ** 0.5 and a.std() > 0.1 / 64 ** 0.5  # peft's kaiming-uniform bound, drawn
    hf = LlamaForCausalLM.from_pretrained(str(base_dir)).eval()
    x = _x()
    with torch.no_grad():
        assert (module.model.eval()(x) - hf(x).logits).abs().max() < 1e-5  # the base, read from model.init_from


def test_adapter_init_is_by_name_whatever_the_shard():
    """lora_A's value is its name's: any range of it drawn alone (a rank's FSDP rows) is that range
    of the whole, and another seed draws another adapter."""
    init = lora.LoraInit(None, seed=3)
    name, shape = "model.layers.1.mlp.up_proj.lora_A.default.weight", (8, 160)
    whole = init.full_value(name, shape, torch.device("cpu")).view(-1)
    part = torch.empty(300)
    init.fill_flat(part, name, shape, 500)
    assert torch.equal(part, whole[500:800])
    assert not torch.equal(whole, lora.LoraInit(None, seed=4).full_value(name, shape, torch.device("cpu")).view(-1))
    assert not init.full_value(name.replace("lora_A", "lora_B"), (160, 8), torch.device("cpu")).any()


def test_training_moves_the_adapters_alone(trained):
    cfg, module, trainer, before, _ = trained
    after = dict(module.model.named_parameters())
    base = [n for n in before if not lora.is_adapter(n)]
    assert base and all(torch.equal(after[n].detach(), before[n]) for n in base), "a base parameter changed"
    moved = [n for n in before if lora.is_adapter(n) and not torch.equal(after[n].detach(), before[n])]
    assert len(moved) == 28  # every A and B (B leaves zero at step 1, A from step 2)
    opt = trainer.optimizers[0]
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in after.items() if lora.is_adapter(n)}
    assert {id(p) for p in opt.state} == in_optimizer


def test_checkpoints_hold_the_adapter_and_resume_exactly(trained, tmp_path):
    cfg, straight, _, _, run = trained
    ckpt = run / "checkpoints" / f"step-{STEPS // 2:07d}.ckpt"
    assert_adapter_only_checkpoint(run)
    resumed = _module(cfg)  # a new process: base from model.init_from again, adapters from the checkpoint
    _fit(cfg, resumed, tmp_path / "b", STEPS, ckpt)
    want = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p.detach(), want[name].detach()), name

    state = torch.load(ckpt, weights_only=True)
    state["state_dict"].pop(next(iter(state["state_dict"])))
    torch.save(state, tmp_path / "short.ckpt")
    with pytest.raises(RuntimeError, match="1 adapter tensor.s. missing"):
        _fit(cfg, _module(cfg), tmp_path / "c", STEPS, tmp_path / "short.ckpt")


def test_final_adapter_loads_in_peft_with_the_same_logits(trained, base_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    cfg, module, trainer, _, _ = trained
    assert lora.export_adapter(tmp_path, cfg, trainer, module, rank=0) == "final/"
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(peft_keys(base_dir, tmp_path))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["task_type"], config["r"], config["lora_alpha"]) == (
        str(base_dir), "CAUSAL_LM", 4, 8)
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(base_dir)), str(tmp_path)).eval()
    x = _x()
    with torch.no_grad():
        want, got = module.model.eval()(x), peft(x).logits
        assert (got - want).abs().max() < 1e-5
        with peft.disable_adapter():
            assert (got - peft(x).logits).abs().max() > 1e-3  # the adapter is in play


def test_hf_causal_lm_takes_adapters_under_its_own_names(base_dir, tmp_path):
    """model=hf_causal_lm (the transformers model itself, its weights from model.config): step 0 is
    the base, two steps train the adapters, and the export is what peft loads, same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _cfg(base_dir, *LORA, model="hf_causal_lm")
    module = _module(cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    x = _x()
    with torch.no_grad():
        base = hf(x).logits
        assert (module.forward(x) - base).abs().max() < 1e-5
    trainer = _fit(cfg, module, tmp_path / "fit", 2)
    lora.export_adapter(tmp_path / "final", cfg, trainer, module, rank=0)
    peft = PeftModel.from_pretrained(hf, str(tmp_path / "final")).eval()  # wraps hf in place
    with torch.no_grad():
        assert (peft(x).logits - module.eval().forward(x)).abs().max() < 1e-5
        assert (peft(x).logits - base).abs().max() > 1e-4


def test_the_plan_counts_grads_and_optimizer_on_the_adapters():
    """llama3_8b on h100x8 under fsdp: r=16 on q/k/v/o/gate/up/down adds 41.9M parameters beside
    the frozen weights; gradients and AdamW states shrink to the adapters' (1/191 of the model's).
    (`loom plan --rehearse` measures the same bytes for llama_tiny: +0% on all three.)"""
    args = ["model=llama3_8b", "hardware=h100x8", "strategy=fsdp"]
    full, adapted = make_plan(resolve(args)), make_plan(resolve([*args, "model.lora.r=16"]))
    assert full.trainable_params is None and adapted.trainable_params == 32 * 16 * (
        2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    f, a = full.memory_per_device_bytes, adapted.memory_per_device_bytes
    ratio = adapted.trainable_params / adapted.params
    assert a["params"] == pytest.approx(f["params"] * (1 + ratio))  # the frozen base and the adapters
    assert a["grads"] == pytest.approx(f["grads"] * ratio) and a["optimizer"] == pytest.approx(f["optimizer"] * ratio)
    # the AdamW states alone save ~8 GB (the gradients are freed before forward: under the activations)
    assert a["total"] == pytest.approx(f["total"] - (f["optimizer"] - a["optimizer"]) + (a["params"] - f["params"]))
    assert a["total"] < f["total"] - 7.9e9
    # FLOPs (MFU): the frozen weights' gradient (2 of their 6 per token) is not computed; the adapters' is
    n = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096 + 128256 * 4096  # 6N's N
    assert adapted.flops_per_token == pytest.approx(full.flops_per_token - 2 * n + 6 * adapted.trainable_params)
    assert adapted.flops_per_token / full.flops_per_token == pytest.approx(0.674, abs=0.001)


@pytest.mark.parametrize("overrides, named", [
    (["model=gpt_tiny", "model.lora.r=16"], "model.lora (LoRA adapters) is for model=llama* and model=hf_causal_lm"),
    (["model=llama_tiny", "model.lora.r=16", "strategy=fsdp_tp", "hardware.devices=2"], "tensor parallelism (tp=2)"),
    (["model=llama_tiny", "model.lora.r=16", "strategy=pp", "hardware.devices=2", "model.tie_embeddings=false"],
     "pipeline stages (pp=2)"),
    (["model=llama_tiny", "model.lora.r=16", "model.lora.target_modules=[q_proj,qkv]"],
     "'qkv' names no Linear module of model=llama_tiny"),
    (["model=llama_tiny", "model.lora.r=16", "model.lora.target_modules=[embed_tokens]"], "q_proj, k_proj, v_proj"),
    (["model=llama_tiny", "model.lora.r=-2"], "model.lora.r=-2: must be >= 0"),
    (["model=llama_tiny", "model.lora.r=8", "model.lora.alpha=0"], "model.lora.alpha=0.0: must be > 0"),
    (["model=llama_tiny", "model.lora.r=8", "model.lora.dropout=1.0"], "model.lora.dropout=1.0: must be in [0, 1)"),
])
def test_what_lora_cannot_run_is_refused_before_launch(tmp_path, overrides, named):
    text = refused(tmp_path, "hardware=cpu", *overrides)
    assert named in text, text


def test_hf_causal_lm_targets_are_its_own_module_names(base_dir, tmp_path):
    text = refused(tmp_path, "model=hf_causal_lm", f"model.config={base_dir}", "hardware=cpu",
                   "model.lora.r=8", "model.lora.target_modules=[c_attn]")
    assert "'c_attn' names no Linear module of model=hf_causal_lm" in text and "lm_head" in text, text
