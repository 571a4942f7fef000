"""Checks of a LoRA run's directory (model.lora.r > 0, loom.models.lora's contract), for the
in-process tests (tests/test_lora.py) and for a shared `loom train` launch to carry:

    assert_adapter_only_checkpoint(run_dir)      the newest checkpoint holds the adapter alone
    assert_optimizer_state_is_the_adapters(run_dir)  summary.json: optimizer bytes = the adapters' AdamW states
    assert_peft_final(run_dir, base_dir)         final/ is a peft adapter dir PeftModel loads (trained)
    assert_same_adapter(run_a, run_b)            bit-equal adapters (a run and its resumed copy)

Whatever strategy wrote the checkpoint: a torch.save file (single, ddp), a DCP directory (fsdp)
or a DeepSpeed directory (zero*)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def make_hf_llama(dest: Path, tie: bool = False, seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM (vocab 300, width 64, 2 layers, GQA 4/2) with random weights (norms
    too, so none sits at its init value), saved with save_pretrained: a base to adapt, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(dest))
    return dest


def _is_adapter(key: str) -> bool:
    return any(part in key for part in ADAPTER_PARTS)


def _newest(run_dir: Path) -> Path:
    from loom.rundir.checkpoints import newest_checkpoint

    ckpt = newest_checkpoint(Path(run_dir))
    assert ckpt is not None, f"no complete checkpoint in {run_dir}"
    return ckpt


def checkpoint_keys(run_dir: Path) -> tuple[list[str], list[str]]:
    """(model-state keys, names of the parameters holding optimizer state) of the newest checkpoint."""
    ckpt = _newest(run_dir)
    if ckpt.is_file():  # single, ddp: one torch.save file; optimizer state is keyed by position
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model = list(state["state_dict"])
        held = sorted({i for opt in state["optimizer_states"] for i in opt["state"]})
        assert held == list(range(len(model))), "optimizer state for more parameters than the checkpoint's model"
        return model, model
    if (ckpt / ".metadata").is_file():  # DCP (fsdp): flattened "state_dict.<key>", "optimizer_0.state.<key>.<slot>"
        from torch.distributed.checkpoint import FileSystemReader

        keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
        model = [k.removeprefix("state_dict.") for k in keys if k.startswith("state_dict.")]
        held = sorted({k.removeprefix("optimizer_0.state.").rsplit(".", 1)[0]
                       for k in keys if k.startswith("optimizer_0.state.")})
        return model, held
    states = sorted((ckpt / "checkpoint").glob("*model_states.pt"))  # DeepSpeed: rank 0's (zero3: one per rank)
    assert states, f"{ckpt}: neither a torch.save file, a DCP directory nor a DeepSpeed checkpoint"
    state = torch.load(states[0], map_location="cpu", weights_only=False)
    held = [name for group in state["param_shapes"] for name in group]  # the optimizer's parameters, by name
    return list(state["module"]), held


def assert_adapter_only_checkpoint(run_dir: Path) -> None:
    """The newest checkpoint's model state and optimizer state are the LoRA adapters' alone."""
    model, held = checkpoint_keys(run_dir)
    base = [k for k in model if not _is_adapter(k)]
    assert model and not base, f"base parameters in the checkpoint: {base[:4]}"
    assert all(k.startswith("model.") for k in model), model[:4]  # LightningModule names: model.<path>...
    assert sorted(held) == sorted(model) or all(_is_adapter(k) for k in held), held[:4]


def adapter_numel(run_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(run_dir) / "final" / "adapter_model.safetensors"), "pt") as f:
        return sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())


def assert_optimizer_state_is_the_adapters(run_dir: Path) -> None:
    """summary.json's optimizer-state bytes are AdamW's m and v (fp32) of the adapters alone:
    whole on every rank (single, ddp), split over the ranks (fsdp), or with ZeRO's fp32 master
    copy beside them, partitioned (zero*)."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    held, world, n = summary["memory"]["optim_state_bytes_per_rank"], summary["world_size"], adapter_numel(run_dir)
    if summary["strategy"].startswith("zero"):
        assert all(b == 12 * n // world for b in held), (held, n)
    elif summary["strategy"] == "fsdp":
        assert sum(held) == 8 * n, (held, n)
    else:
        assert all(b == 8 * n for b in held), (held, n)


def peft_keys(base_dir: Path, final: Path) -> list[str]:
    """The keys `get_peft_model_state_dict` gives for a PeftModel of the base with final/'s config."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    return list(get_peft_model_state_dict(get_peft_model(model, LoraConfig.from_pretrained(str(final)))))


def assert_peft_final(run_dir: Path, base_dir: Path) -> None:
    """final/ is a peft adapter directory: exactly peft's keys, its config naming the base, loaded by
    PeftModel.from_pretrained, and trained (some lora_B, which starts at zero, is not zero)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = Path(run_dir) / "final"
    assert json.loads((Path(run_dir) / "summary.json").read_text())["final_weights"] == "final/"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in final.iterdir()}
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["peft_type"] == "LORA", config
    tensors = load_file(str(final / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(peft_keys(base_dir, final))
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if ".lora_B." in k), "the adapter never trained"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir)), str(final))
    loaded = {k: v for k, v in model.state_dict().items() if _is_adapter(k)}
    assert len(loaded) == len(tensors)


def assert_same_adapter(run_a: Path, run_b: Path) -> None:
    """Both runs' final adapters are bit for bit the same (a run, and a copy of it resumed)."""
    from safetensors.torch import load_file

    a, b = (load_file(str(Path(r) / "final" / "adapter_model.safetensors")) for r in (run_a, run_b))
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} adapter tensor(s) differ, e.g. {different[:2]}"
