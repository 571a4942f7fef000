"""Meta-device construction and activation checkpointing (issue 14).

Fast tests check the name-seeded initialization and activation checkpointing without
processes (the same loss and gradients with and without it, and less saved for backward); the
slow ones launch two real 2-process runs of `model=gpt_1b model.n_layer=4` (~207M parameters,
0.77 GiB in fp32; 2048-wide, so each rank's shard of a weight spans several CHUNKs) under fsdp
and zero3, one step and no validation, whose build-time peak RSS (summary.json
`memory.build_peak_rss_gb_per_rank`) shows that sharded strategies never hold the whole model
(issue 35: zero3 within 0.6x of ddp's, whose build holds the whole fp32 model: 0.769 GiB
measured above the same base, 0.770 GiB of parameters), and whose step-1 losses agree. Activation checkpointing in real processes rides on shared runs:
zero3's parity run and the compiled fsdp run (tests/test_strategies.py, tests/test_compile.py).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import FAST, launching_fixture, run_loom
from torch import nn

from loom.models import build_module
from loom.models.gpt.network import gpt_rule
from loom.models.init import CHUNK, NamedInit
from loom.pipeline import resolve

# plain SGD: the build is what these runs measure, and AdamW's first step over 207M parameters
# (its m and v allocated and written) took half of ddp's 18 s run here, a third of fsdp's
BIG = ["model=gpt_1b", "model.n_layer=4", "hardware=cpu", *FAST, "trainer.max_steps=1", "dataset.seq_len=16",
       "trainer.limit_val_batches=0", "optim=sgd", "optim.momentum=0"]
# A sharded build holds at most its half of the fp32 model plus, briefly, one whole parameter
# being initialized before it is sharded: the largest, gpt_1b's MLP up projection (4 x 2048 x
# 2048). GiB, as build_peak_rss_gb_per_rank (ru_maxrss).
LARGEST_PARAM_GIB = 4 * 2048 * 2048 * 4 / 2**30
SLACK_GIB = 0.03
# Issue 35: at 2 ranks a sharded build stays within 0.6x of ddp's above the same plain process; ddp's
# build is the whole fp32 model (measured 0.769 GiB against 0.770 of parameters), so the bound is
# taken against the model's own bytes and ddp's 15 s launch is not repeated here.
# (Measured here, GiB above ddp's gpt_tiny run: ddp 0.770; fsdp 0.391; zero3 0.571 while DeepSpeed
# imported mlflow, 0.469 without it, 0.415 once zero.Init no longer writes whole parameters.)
SHARDED_OF_DDP = 0.6
AC_TOL = 1e-5


def test_any_range_of_a_parameter_draws_the_same_values():
    init = NamedInit(7, gpt_rule(2))
    shape = (3 * CHUNK // 1000 + 5, 1000)
    full = init.full_value("blocks.0.mlp.fc.weight", shape, torch.device("cpu"))
    for start, n in ((0, 10), (CHUNK - 3, 7), (123_457, 2 * CHUNK)):
        part = torch.empty(n)
        init.fill_flat(part, "blocks.0.mlp.fc.weight", shape, start)
        assert torch.equal(part, full.view(-1)[start:start + n])
    # Drawn by a CPU generator whatever the destination device (CUDA's draws other numbers for
    # the same seed): the values are the CPU generator's, so GPU and CPU runs start alike.
    from loom.models.init import param_seed

    first = torch.empty(CHUNK).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(
        param_seed(7, "blocks.0.mlp.fc.weight#0")))
    assert torch.equal(full.view(-1)[:CHUNK], first)
    other = init.full_value("blocks.1.mlp.fc.weight", shape, torch.device("cpu"))
    assert not torch.equal(full, other)
    assert abs(full.std().item() - 0.02) < 1e-3


def test_drawing_ignores_the_default_device():
    """Lightning builds under `torch.device("cuda")` as the default device: a chunk made without
    a device landed on CUDA beside a CPU generator, and every GPU single/zero run died at step 0
    ("Expected a 'cuda' device type for generator", first H100 run). `meta` stands in for CUDA
    here: a chunk made there would fail the copy into the CPU destination."""
    from loom.models.lora import LoraInit

    init = NamedInit(7, gpt_rule(2))
    shape = (CHUNK // 500, 1000)
    want = init.full_value("blocks.0.mlp.fc.weight", shape, torch.device("cpu"))
    lora = LoraInit(init, 7)
    want_a = lora.full_value("blocks.0.mlp.fc.lora_A.default.weight", (8, 1000), torch.device("cpu"))
    with torch.device("meta"):
        got = torch.empty(want.numel(), device="cpu")
        init.fill_flat(got, "blocks.0.mlp.fc.weight", shape, 0)
        got_a = torch.empty(8 * 1000, device="cpu")
        lora.fill_flat(got_a, "blocks.0.mlp.fc.lora_A.default.weight", (8, 1000), 0)
    assert torch.equal(got, want.view(-1))
    assert torch.equal(got_a, want_a.view(-1))


def test_meta_build_equals_a_plain_gpt_with_the_same_seed():
    from loom.models.gpt.network import GPT
    from loom.models.lit import network_kwargs

    cfg = resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1"])
    module = build_module(cfg)
    module.configure_model()
    assert not any(p.is_meta for p in module.model.parameters())
    torch.manual_seed(cfg.seed)
    plain = GPT(**network_kwargs(cfg.model))
    ours, ref = module.model.state_dict(), plain.state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert module.build_peak_rss_gb > 0


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_user_module_without_reset_parameters_is_built_in_full_and_says_why(caplog):
    from loom.models.lit import WrappedModule

    cfg = resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1"])
    module = WrappedModule(cfg, _NoReset, None)
    with caplog.at_level(logging.INFO, logger="loom"):
        module.configure_model()
    assert not module.model.w.is_meta
    assert "cannot be built on the meta device" in caplog.text and "_NoReset" in caplog.text


def test_user_module_with_reset_parameters_is_built_on_meta_reproducibly():
    from loom.models.lit import WrappedModule

    cfg = resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1"])

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    built = []
    for _ in range(2):
        torch.manual_seed(999 + len(built))  # the global RNG must not matter
        m = WrappedModule(cfg, net, None)
        m.configure_model()
        built.append(m.model.state_dict())
    assert all(torch.equal(built[0][k], built[1][k]) for k in built[0])
    assert built[0]["0.weight"].abs().max() <= 1 / 8 ** 0.5 + 1e-6  # nn.Linear's own init bound


# ----------------------------------------------------------------------------- real processes


@launching_fixture(scope="module")
def big_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("meta")
    return {s: run_loom("train", f"strategy={s}", *BIG, "dataset.batch_size=1", root=root, timeout=600)
            for s in ("fsdp", "zero3")}


def _build_peak(run) -> float:
    return max(run.summary()["memory"]["build_peak_rss_gb_per_rank"])


@pytest.mark.slow
def test_sharded_strategies_never_build_the_whole_model(big_runs, strategy_runs):
    """Each build's peak above ddp's gpt_tiny run (the same data, a process without DeepSpeed):
    what a rank holds to build the model, its strategy's runtime included, so a ZeRO rank that
    imports more (mlflow through DeepSpeed's autotuner: +0.12 GiB) counts, as a whole parameter
    written before it is partitioned does."""
    for name, r in big_runs.items():
        assert r.rc == 0, (name, r.out[-3000:], r.err[-3000:])
    base = _build_peak(strategy_runs["ddp"])
    extra = {s: _build_peak(big_runs[s]) - base for s in ("fsdp", "zero3")}
    print({s: round(v, 3) for s, v in extra.items()},
          {s: big_runs[s].summary()["memory"]["build_peak_rss_gb_per_rank"] for s in big_runs})
    whole = sum(big_runs["fsdp"].summary()["memory"]["param_bytes_per_rank"]) / 2**30  # the shards, whole
    assert whole == pytest.approx(sum(big_runs["zero3"].summary()["memory"]["param_bytes_per_rank"]) / 2**30)
    assert 0.7 < whole < 0.8, whole  # 207M fp32 parameters: the model the bound is about
    for s in ("fsdp", "zero3"):  # 2 ranks: about half the model
        assert extra[s] <= whole / 2 + LARGEST_PARAM_GIB + SLACK_GIB, (s, extra, whole)
        assert extra[s] <= SHARDED_OF_DDP * whole, (s, extra, whole)


def test_a_zero_rank_imports_deepspeed_without_mlflow():
    """DeepSpeed's autotuner imports mlflow whenever it is installed (loom[tracking] installs
    mlflow-skinny): mlflow, pandas, opentelemetry and fastapi were in every ZeRO rank, +0.12 GiB
    of its build peak. A fresh interpreter (this one may hold either already) imports DeepSpeed
    as a CPU ZeRO rank does; mlflow stays importable afterwards, for tracking=mlflow."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed: DeepSpeed has nothing to pull in")
    code = ("import sys; from loom.strategies.deepspeed import use_cpu_accelerator; use_cpu_accelerator(); "
            "import deepspeed.autotuning.autotuner as a; "
            "print(sorted(m for m in ('mlflow', 'pandas', 'opentelemetry') if m in sys.modules), a.has_mlflow); "
            "import mlflow; print(mlflow.__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n")[:2] == ["[] False", "mlflow"], p.stdout


@pytest.mark.slow
def test_meta_built_strategies_start_from_the_same_weights(big_runs):
    """At 207M parameters (init ranges crossing CHUNK boundaries inside each shard): the same
    step-1 loss whether FSDP2 writes row shards or ZeRO-3 flat partitions (measured 5.5036442 for
    both, and 5.5036440 for the model built whole by `single` at the same global batch). That
    these equal `single`'s is every parity run's (tests/test_strategies.py, gpt_tiny), and that
    any range of a parameter draws the same values, test_any_range_of_a_parameter_draws_the_same_values'."""
    fsdp, zero3 = big_runs["fsdp"].losses()[1], big_runs["zero3"].losses()[1]
    # at init the model predicts near-uniformly over the 256 byte ids the loss covers: ln 256 = 5.545
    assert abs(fsdp - zero3) < 1e-5 and abs(fsdp - math.log(256)) < 0.1, (fsdp, zero3)


# ----------------------------------------------------------------------------- activation checkpointing


def _ac_step(mode: str, n_layer: int = 2, batch: int = 8) -> tuple[float, dict, int]:
    """gpt_tiny built as the worker builds it (configure_model: meta device, name-seeded init,
    then `trainer.activation_checkpointing=mode`), one forward/backward on fixed tokens: the
    loss, the gradients, and the bytes autograd saved for backward outside checkpointed blocks
    (a checkpointed block keeps only its input and recomputes the rest in backward)."""
    cfg = resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1",
                   f"model.n_layer={n_layer}", f"trainer.activation_checkpointing={mode}"])
    module = build_module(cfg)
    module.configure_model()
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, 129), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = module.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in module.model.named_parameters()}
    return loss.item(), grads, sum(saved)


def test_activation_checkpointing_changes_no_loss_or_gradient():
    """The recompute is the same math on the same inputs: loss and every gradient as without
    it (the two wrapping paths run it in real processes: zero3's parity run, the compiled fsdp
    run, both matching `single`)."""
    loss, grads, _ = _ac_step("none")
    for mode in ("selective", "full"):
        got_loss, got, _ = _ac_step(mode)
        assert abs(got_loss - loss) <= AC_TOL, (mode, got_loss, loss)
        assert got.keys() == grads.keys()
        for k in grads:
            torch.testing.assert_close(got[k], grads[k], rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_saves_less_for_backward():
    """4 blocks, 8 x 128 tokens: what autograd keeps from forward to backward (the activation
    memory) falls with every block checkpointed: selective keeps half the blocks' activations."""
    saved = {mode: _ac_step(mode, n_layer=4)[2] for mode in ("none", "selective", "full")}
    print("bytes saved for backward", saved)
    assert saved["full"] < 0.5 * saved["none"], saved
    assert saved["full"] < saved["selective"] < saved["none"], saved
