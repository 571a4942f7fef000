"""`model=hf_causal_lm strategy=zero3` for architectures whose init touches a parameter's rows
(issue 35): transformers' `_init_weights` zeroes `embed.weight[pad_token_id]`, which under
`deepspeed.zero.Init` indexed an already partitioned (empty) tensor: IndexError on every rank.

In process, no launch: each rank of a 2-rank world in turn, on torch's fake process group (its
collectives return at once), builds the module as the worker does: the real CPU DeepSpeed
strategy of the resolved config, its `model_sharded_context` (Lightning's `zero.Init` with the
strategy's DeepSpeed config), then `models.construct`. What each rank keeps of every parameter
(`ds_tensor`) must be its slice of `single`'s weights for the same seed, padding rows included.
"""

from __future__ import annotations

import pytest
import torch

from loom.models import build_module
from loom.models.construct import construct
from loom.pipeline import resolve

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2}
WORLD = 2


def _save_config(arch: str, path) -> int:
    """A tiny Gemma-2 (pad row 0: rank 0's partition, head tied) or Phi-3 (pad row 127: rank 1's,
    head untied) config.json in `path`; its pad_token_id."""
    from transformers import Gemma2Config, Phi3Config

    if arch == "gemma2":
        config = Gemma2Config(**TINY, num_key_value_heads=1, head_dim=16, pad_token_id=0)
    else:
        config = Phi3Config(**TINY, num_key_value_heads=2, pad_token_id=127, original_max_position_embeddings=64)
    config.save_pretrained(path)
    return int(config.pad_token_id)


def _args(path, strategy: str) -> list[str]:
    devices = 1 if strategy == "single" else WORLD
    return ["model=hf_causal_lm", f"model.config={path}", "model.random_init=true", f"strategy={strategy}",
            "hardware=cpu", f"hardware.devices={devices}", "dataset=synthetic", "dataset.seq_len=32",
            "dataset.vocab_size=128", "seed=11"]


def _zero3_rank(path, rank: int, monkeypatch) -> torch.nn.Module:
    """Rank `rank`'s model, built under the zero3 strategy's zero.Init as the worker builds it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loom.strategies import build_strategy, layout_of

    monkeypatch.setenv("LOCAL_RANK", str(rank))  # DeepSpeed's Init and Lightning's environment read it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        cfg = resolve(_args(path, "zero3"))
        strategy = build_strategy(cfg, layout_of(cfg))
        strategy.parallel_devices = [torch.device("cpu")] * WORLD  # what Lightning's connector sets
        module = build_module(cfg)
        with strategy.model_sharded_context():
            construct(module, strategy)
        return module.model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_hf_causal_lm_with_a_pad_token_builds_under_zero3_with_single_s_weights(arch, tmp_path, monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    pad = _save_config(arch, tmp_path)
    ref = build_module(resolve(_args(tmp_path, "single")))
    ref.configure_model()
    full = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    embed = ref.model.get_input_embeddings().weight
    # transformers' init: the padding row starts at zero (it never gets a gradient); the others drawn
    others = torch.cat([embed[:pad], embed[pad + 1:]])
    assert not embed[pad].any() and abs(others.std().item() - 0.02) < 2e-3
    tied = ref.model.get_output_embeddings().weight is embed
    assert tied is (arch == "gemma2")
    # norm gains as the architecture's own init leaves them: Gemma multiplies by 1 + w (zeros), Phi-3 by w
    gains = {n: p for n, p in ref.model.named_parameters() if n.endswith("norm.weight")}
    assert gains and all(bool((p == (0.0 if arch == "gemma2" else 1.0)).all()) for p in gains.values()), gains
    init_fns, zero_init = torch.nn.init.normal_, Init._zero_init_param

    for rank in range(WORLD):
        model = _zero3_rank(tmp_path, rank, monkeypatch)
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
        names = [n for n, _ in model.named_parameters()]
        assert names == list(full), (names, list(full))
        for name, p in model.named_parameters():
            assert tuple(p.ds_shape) == tuple(full[name].shape) and p.numel() == 0, name  # partitioned
            part = p.ds_tensor.view(-1)
            mine = full[name].view(-1)[rank * part.numel():(rank + 1) * part.numel()]
            assert torch.equal(part[:mine.numel()], mine), (rank, name)
            assert not part[mine.numel():].any(), (rank, name)  # DeepSpeed's padding of the last partition
    # the build's temporary no-op torch init and broadcast-free partitioning are undone
    assert torch.nn.init.normal_ is init_fns and Init._zero_init_param is zero_init


def test_bin_only_pretrained_weights_under_zero3_are_refused_before_launch(tmp_path):
    """transformers' from_pretrained loads `.bin` weights whole into modules ZeRO-3 has already
    partitioned: refused at validation naming the ways out, each of which is accepted."""
    from conftest import refused
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    model.config.save_pretrained(tmp_path / "gpt2")
    torch.save(model.state_dict(), tmp_path / "gpt2" / "pytorch_model.bin")
    args = ["model=hf_causal_lm", f"model.config={tmp_path / 'gpt2'}", "dataset=synthetic", "dataset.seq_len=32",
            "dataset.vocab_size=300", "hardware=cpu"]
    err = refused(tmp_path, *args, "strategy=zero3")
    assert "model.config=" in err and "holds only .bin weights, which ZeRO-3 cannot load" in err, err
    assert "(strategy=zero3)" in err
    assert "strategy=fsdp" in err and "model.random_init=true" in err and "safe_serialization=True" in err
    for way_out in (["strategy=fsdp"], ["strategy=zero3", "model.random_init=true"]):
        assert resolve([*args, *way_out]).strategy.name == way_out[0].split("=")[1]
    from transformers import AutoModelForCausalLM  # the advice's one-time conversion, as written

    AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    assert resolve([*args, "strategy=zero3"]).strategy.name == "zero3"
