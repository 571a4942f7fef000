"""`loom export --format peft|hf` of a LoRA run (loom.export.adapter): the adapter directory peft
loads, or the adapter merged into its base by peft.

No launch: the run dir is made here following the LoRA run contract (issue 38): config.yaml with
`model.lora`, checkpoints holding the adapter tensors alone under the network's peft-style names
(`model.<path>.lora_A.default.weight`), final/ the directory `PeftModel.save_pretrained` writes.
The adapter is peft's own, on a tiny LlamaForCausalLM saved here (the run's model.init_from); one
more check saves the adapters of Loom's own LoRA network (loom.models.lora, built in-process as the
worker builds it) as a checkpoint does, and exports them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_export import ONE_CPU, _fake_run, _loom, _wrote
from test_llama_runs import HF_SHAPE

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
X = torch.randint(0, HF_SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))


def _base(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF_SHAPE)).save_pretrained(path)
    return path


def _logits(model) -> torch.Tensor:
    """A transformers model's logits, or Loom's network's (it returns the tensor)."""
    with torch.no_grad():
        out = model(X)
    return getattr(out, "logits", out)


def _peft_logits(base: Path, adapter: Path) -> torch.Tensor:
    """What peft users get: the base from its directory, the adapter loaded by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return _logits(PeftModel.from_pretrained(model, adapter).eval())


def write_lora_config(run: Path, cfg, lora: dict) -> None:
    """config.yaml of `cfg` with `model.lora` set (whether or not the schema has it yet)."""
    from loom.rundir.config_file import frozen_yaml

    container = OmegaConf.to_container(cfg, resolve=True)
    container["model"]["lora"] = lora
    (run / "config.yaml").write_text(frozen_yaml(OmegaConf.create(container)))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    """A completed LoRA run of 4 steps: checkpoints of steps 2 and 4 (adapter tensors alone), final/
    peft's adapter directory of step 4; the logits peft computes with each step's adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from loom.pipeline import resolve

    root = tmp_path_factory.mktemp("lora")
    base = _base(root / "base")
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    write_lora_config(run, resolve(["model=llama", f"model.init_from={base}", *ONE_CPU, "run.id=lora"]), LORA)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))
    model.eval()
    network = model.base_model.model  # Loom's network under LoRA: peft's names inside the model
    logits = {}
    for step in (2, 4):
        torch.manual_seed(step)
        with torch.no_grad():  # lora_B starts at zero: move both away from init so the adapter counts
            for name, p in network.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.2)
        state = {f"model.{k}": v.detach().clone() for k, v in network.named_parameters() if "lora_" in k}
        torch.save({"state_dict": state, "global_step": step}, run / "checkpoints" / f"step-{step:07d}.ckpt")
        logits[step] = _logits(model)
    model.save_pretrained(run / "final")
    (run / "summary.json").write_text(json.dumps({"status": "completed", "global_step": 4, "final_weights": "final"}))
    return {"run": run, "base": base, "logits": logits}


def test_peft_export_is_peft_own_adapter_and_loads_with_the_same_logits(lora_run):
    """Of final/ (default) and of the step-2 checkpoint: the keys peft's save_pretrained wrote,
    loaded by PeftModel.from_pretrained with the logits of that step's adapter."""
    run, base = lora_run["run"], lora_run["base"]
    rc, out, err = _loom("export", str(run), "--format", "peft")
    assert rc == 0, err
    final = _wrote(out)
    assert final == run / "export" / "peft-step-4" and "final (step 4)" in out
    assert set(load_file(final / "adapter_model.safetensors")) == set(load_file(run / "final" / "adapter_model.safetensors"))
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert torch.equal(_peft_logits(base, final), lora_run["logits"][4])

    rc, out, err = _loom("export", str(run), "--format", "peft", "--step", "2")
    assert rc == 0, err
    assert "checkpoints/step-0000002.ckpt (step 2)" in out
    assert torch.equal(_peft_logits(base, _wrote(out)), lora_run["logits"][2])


def test_a_killed_lora_runs_checkpoint_exports_an_adapter_config_made_from_model_lora(lora_run, tmp_path):
    """No final/: the newest checkpoint's adapter, with peft's LoraConfig of model.lora (its
    target modules those the adapter holds) naming model.init_from as the base."""
    run = tmp_path / "killed"
    shutil.copytree(lora_run["run"], run, ignore=shutil.ignore_patterns("final", "summary.json", "export"))
    rc, out, err = _loom("export", str(run), "--format", "peft")
    assert rc == 0, err
    config = json.loads((_wrote(out) / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(lora_run["base"])
    assert torch.equal(_peft_logits(lora_run["base"], _wrote(out)), lora_run["logits"][4])


def test_hf_export_of_a_lora_run_is_the_base_with_the_adapter_merged(lora_run):
    """A plain directory from_pretrained loads (no peft), with the logits of base + adapter."""
    from transformers import AutoModelForCausalLM

    run = lora_run["run"]
    for step in (2, 4):
        rc, out, err = _loom("export", str(run), "--format", "hf", "--step", str(step))
        assert rc == 0, err
        merged = _wrote(out)
        assert merged == run / "export" / f"hf-step-{step}"
        assert {"config.json", "model.safetensors", "loom-export.json"} <= {p.name for p in merged.iterdir()}
        assert not any("lora" in k for k in load_file(merged / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        worst = (_logits(model) - lora_run["logits"][step]).abs().max().item()
        assert worst < 1e-4, worst


def test_what_a_lora_run_or_a_whole_run_cannot_export_is_refused(lora_run, tmp_path):
    whole, _ = _fake_run(tmp_path / "whole", "llama_tiny", (2,))
    rc, _, err = _loom("export", str(whole), "--format", "peft")
    assert rc == 2 and "model.lora.r=0" in err and "use --format hf or --format loom" in err, err
    rc, _, err = _loom("export", str(lora_run["run"]), "--format", "loom")
    assert rc == 2 and "model.lora.r=4" in err and "--format peft" in err, err
    moved = tmp_path / "moved"
    shutil.copytree(lora_run["run"], moved, ignore=shutil.ignore_patterns("export"))
    cfg = OmegaConf.load(moved / "config.yaml")
    cfg.model.init_from = str(tmp_path / "gone")
    OmegaConf.save(cfg, moved / "config.yaml")
    rc, _, err = _loom("export", str(moved), "--format", "hf")
    assert rc == 2 and f"model.init_from={tmp_path / 'gone'} is no Hugging Face directory" in err, err
    assert len(err.strip().splitlines()) == 1, err
    del cfg.model["init_from"]
    OmegaConf.save(cfg, moved / "config.yaml")
    rc, _, err = _loom("export", str(moved), "--format", "hf")
    assert rc == 2 and "initialized by Loom from the seed" in err and "use --format peft" in err, err


def test_a_checkpoint_of_looms_own_lora_network_exports_what_peft_and_transformers_load(tmp_path):
    """Loom's LoRA llama built as the worker builds it (model.lora.r=4 on model.init_from), its
    adapters moved and saved as a single/ddp checkpoint holds them: the peft export loads in
    PeftModel and the hf export in transformers, each with the logits of Loom's network."""
    from loom.models import build_module
    from loom.pipeline import resolve
    from loom.rundir.config_file import frozen_yaml

    base = _base(tmp_path / "base")
    cfg = resolve(["model=llama", f"model.init_from={base}", *ONE_CPU, "run.id=real", "model.lora.r=4",
                   "model.lora.alpha=8"])
    module = build_module(cfg)
    module.init_source = cfg.model.init_from
    module.configure_model()
    network = module.model.eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in network.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(frozen_yaml(cfg))
    state = {f"model.{k}": v for k, v in network.state_dict().items() if "lora_" in k}
    torch.save({"state_dict": state, "global_step": 3}, run / "checkpoints" / "step-0000003.ckpt")
    want = _logits(network)
    rc, out, err = _loom("export", str(run), "--format", "peft")
    assert rc == 0, err
    assert (_peft_logits(base, _wrote(out)) - want).abs().max().item() < 1e-5
    rc, out, err = _loom("export", str(run), "--format", "hf")
    assert rc == 0, err
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(_wrote(out), dtype=torch.float32).eval()
    assert (_logits(merged) - want).abs().max().item() < 1e-4
