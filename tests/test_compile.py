"""`trainer.compile`: torch.compile (inductor's C++ backend on CPU) of each FSDP unit or of
the whole model, under the strategies that can run it; refused where they cannot.

The eager reference is the shared `single` run (conftest.single_run); the compiled runs are the
parity runs of fsdp (plus activation checkpointing, per-block compile before fully_shard), ddp
and zero2 (whole model) with `trainer.compile=true` (conftest.strategy_args): every strategy
matches `single` eagerly (tests/test_strategies.py), so a compiled run must too, within 1e-3
after 10 steps (inductor fuses and reorders float32 math: measured differences ~1e-6). The fsdp
one is also the test that activation checkpointing under FSDP2 trains like `single`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import STEPS, launching_fixture, strategy_args

from loom.errors import ConfigError
from loom.pipeline import resolve

COMPILED = {"fsdp": ["trainer.activation_checkpointing=full"], "ddp": [], "zero2": []}


def test_compile_keeps_parameter_and_state_dict_names():
    """Only `forward` is compiled: name-seeded init, checkpoints and final weights see the
    same names and values as an eager build (no `_orig_mod.` segment)."""
    from loom.models import build_module

    built = {}
    for flag in ("false", "true"):
        module = build_module(resolve(["model=gpt_tiny", f"trainer.compile={flag}"]))
        module.configure_model()
        built[flag] = module.model
    eager, compiled = built["false"], built["true"]
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(compiled.state_dict().values(), eager.state_dict().values(), strict=True))
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    assert hasattr(compiled.forward, "_torchdynamo_orig_callable")
    assert not hasattr(eager.forward, "_torchdynamo_orig_callable")


@pytest.mark.parametrize("strategy", ["zero3", "zero3_offload"])
def test_compile_is_refused_where_the_strategy_cannot_run_it(strategy):
    with pytest.raises(ConfigError) as e:
        resolve([f"strategy={strategy}", "trainer.compile=true"])
    assert "trainer.compile" in str(e.value) and "recompile" in str(e.value)


@launching_fixture(scope="module")
def compile_runs(shared, single_run) -> dict:
    out = {"eager": single_run}
    for s, extra in COMPILED.items():
        out[s] = shared.get(*strategy_args(s, "trainer.compile=true", *extra))
    return out


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank-*.log")))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(COMPILED))
def test_compiled_losses_match_eager(compile_runs, strategy):
    from safetensors.torch import load_file

    ref, r = compile_runs["eager"], compile_runs[strategy]
    assert ref.rc == 0, ref.out + ref.err
    assert r.rc == 0, r.out + r.err
    assert r.summary()["status"] == "completed" and r.summary()["global_step"] == STEPS
    losses, eager = r.losses(), ref.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in eager.items():
        assert abs(losses[step] - loss) < 1e-3, (step, losses[step], loss)
    log = _logs(r.run_dir)
    # fsdp: gpt_tiny's 2 blocks one by one; the others: the whole model
    assert ("torch.compile: 2 unit forward(s)" if strategy == "fsdp" else "torch.compile: 1 whole-model") in log
    assert "torch.compile" not in _logs(ref.run_dir)
    assert "recompile_limit" not in (r.err + log)  # compiled for real, no fallback to eager
    if strategy == "fsdp":
        assert "activation checkpointing (full): 2 of" in log
    final = load_file(str(r.run_dir / "final" / "model.safetensors"))
    assert final.keys() == load_file(str(ref.run_dir / "final" / "model.safetensors")).keys()
