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

import logging
import re
from pathlib import Path
from types import SimpleNamespace

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
    _assert_compiled_at_step_1_only(r, log)
    assert ref.summary()["recompiles"] == {"count": 0, "steps": [], "reasons": []}
    final = load_file(str(r.run_dir / "final" / "model.safetensors"))
    assert final.keys() == load_file(str(ref.run_dir / "final" / "model.safetensors")).keys()


def _assert_compiled_at_step_1_only(r, log: str) -> None:
    """A compiled run's compile is step 1's, seen by torch's hooks: its seconds are time.compile_s
    (within the first step's), only step 1's line says so, no recompile or warning, and every
    later window (log_every_n_steps=1) is steady. Catches a compile that goes undetected (compile_s
    0, step 1 counted as steady), a validation compile counted as training's (a recompile at step
    10, its window out), and the step-1 compile reported as a recompile."""
    s = r.summary()
    assert s["recompiles"] == {"count": 0, "steps": [], "reasons": []}
    span = s["attempts"][-1]
    assert span["recompiles"] == [] and span["steady_steps"] == STEPS - 1
    assert s["throughput"]["steady"] and s["throughput"]["steady_from_step"] == 1
    assert 0 < s["time"]["compile_s"] < s["time"]["first_step_s"] == span["first_step_s"]
    steps = re.findall(r"\] loom INFO: step (\d+)/\d+ .*?(\(compiling: [\d.]+ s\))?$", log, re.M)
    assert [(int(n), bool(c)) for n, c in steps] == [(n, n == 1) for n in range(1, STEPS + 1)]
    assert "torch recompiled" not in log and "torch compiled on rank" not in log


# ----------------------------------------------------------------------------- compiles found


def _stub_trainer(max_steps: int, world_size: int = 1) -> SimpleNamespace:
    """What the Recorder reads of Lightning's Trainer (the Recorder is what is under test)."""
    return SimpleNamespace(global_step=0, world_size=world_size, global_rank=0, max_steps=max_steps, optimizers=[],
                           loggers=[], accumulate_grad_batches=1, sanity_checking=False, callback_metrics={})


def test_a_recompile_is_found_at_its_step_and_only_its_window_leaves_the_steady_rate(caplog):
    """The Recorder driven as Lightning drives it, around a real torch.compile'd step that
    recompiles when its batch changes shape at step 5, and compiles again (eval, no_grad) in a
    validation after step 3. Log windows of 2 steps: (0,2] warm-up with the first compile,
    (2,4] steady (validation's compile is validation's time), (4,6] out (the recompile), (6,8]
    steady. Catches: a fixed warm-up instead of the hooks (window (4,6] counted: 6 steady steps),
    the old rule that restarted the steady window after a compile (2 steady steps, from step 6),
    validation's compile counted as training's ((2,4] out), the first step's compile reported as a
    recompile, a wrong step stamp, the guard's reason lost, no warning or a warning for step 1."""
    from loom.tracking.recorder import Recorder

    rec = Recorder(log_every=2, samples_per_step=4, seq_len=8, flops_per_token=None,
                   peak_flops_per_device=None, world_size=1)
    trainer, module = _stub_trainer(8), SimpleNamespace(device=torch.device("cpu"), automatic_optimization=True)
    weight = torch.ones(8, requires_grad=True)
    step_fn = torch.compile(lambda x, w: (x * w).square().mean(), backend="aot_eager")
    rec.on_train_start(trainer, module)
    with caplog.at_level(logging.INFO, logger="loom"):
        for step in range(1, 9):
            rec.on_train_batch_start(trainer, module, None, step - 1)
            loss = step_fn(torch.ones(4 if step < 5 else 6, 8), weight)
            loss.backward()
            trainer.global_step = step
            rec.on_train_batch_end(trainer, module, loss, None, step - 1)
            if step == 3:
                rec.on_validation_start(trainer, module)
                with torch.no_grad():
                    step_fn(torch.ones(4, 8), weight)
                rec.on_validation_end(trainer, module)
        rec.on_train_end(trainer, module)
    span = rec.span(8)
    assert (span["steady_steps"], rec.clock.steady_step) == (4, 2)
    assert span["steady_samples"] == 4 * 4
    window_s = {int(r["step"]): r["perf/step_time_ms"] * 2 / 1000 for r in rec.history}
    assert span["steady_train_s"] == pytest.approx(window_s[4] + window_s[8], abs=2e-4)
    [recompile] = span["recompiles"]
    assert recompile["step"] == 5 and "size mismatch at index 0. expected 4, actual 6" in recompile["reason"]
    assert 0 < recompile["seconds"] <= span["compile_s"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"torch recompiled at step 5 ({recompile['reason']}): steps 5-6 left out of the steady "
                        "throughput"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [("compiling" in line) for line in lines] == [True, False, True, False]
    from loom.tracking.compiles import summary_field

    two_attempts = [{"recompiles": span["recompiles"]}, {"recompiles": [{**recompile, "step": 30}]}]
    assert summary_field(two_attempts) == {"count": 2, "steps": [5, 30], "reasons": [recompile["reason"]]}
    assert summary_field([{"end_step": 8}]) == {"count": 0, "steps": [], "reasons": []}


def test_a_compile_on_another_rank_leaves_the_window_out(caplog):
    """Rank 0 compiled nothing in (4,6], rank 1 did (a shape only its data had): rank 0 waited for
    it in the next collective, so the window is out of the steady rate and the warning names rank 1."""
    from loom.tracking.recorder import _FIELDS, Recorder

    rec = Recorder(log_every=2, samples_per_step=4, seq_len=8, flops_per_token=None,
                   peak_flops_per_device=None, world_size=2)
    rec.clock.start(0)
    rec.clock.loop_start = 1.0  # the clock's times below are given, not read
    trainer = _stub_trainer(8, world_size=2)
    col = _FIELDS.index("compile_s")
    with caplog.at_level(logging.WARNING, logger="loom"):
        for step, rank1_compile_s in ((2, 3.0), (4, 0.0), (6, 0.5), (8, 0.0)):
            gathered = torch.zeros(2, len(_FIELDS), dtype=torch.float64)
            gathered[1, col] = rank1_compile_s
            rec._clock_window(trainer, gathered, step, 1.0 + step, [])
            rec.last_log_step = step
    assert (rec.clock.steady_steps, rec.clock.steady_train_s, rec.clock.compile_s) == (4, 4.0, 0.0)
    assert [r.getMessage() for r in caplog.records] == [
        "torch compiled on rank 1: steps 5-6 left out of the steady throughput"]
