"""`loom export RUN_DIR --format hf|loom [--out DIR] [--step N]` (loom.export): a run's weights
exported without training, from its final weights or any strategy's checkpoint.

No launch of its own. The checkpoints read are the shared Llama runs' (tests/test_llama_runs.py:
ddp keeps Lightning `.ckpt` files, fsdp DCP directories, zero3 DeepSpeed ZeRO directories, each
of steps 5 and 10) and the nd pipeline run's (tests/test_nd.py: DCP written by two pipeline
stages); refusals and the writer's name handling run on a run dir made here, in-process. The
CLI runs in this process (`cli.main`, the real verb), except where its torch-free refusal is the
point.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launching_fixture
from safetensors import safe_open
from safetensors.torch import load_file
from test_llama_runs import HF_SHAPE, completed_llama_runs, llama_args
from tests_helpers import assert_refused_without_torch

from loom import cli

ONE_CPU = ["hardware=cpu", "hardware.devices=1", "strategy=single"]


def _loom(*argv: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """`loom <argv>` through the CLI's own main, in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _wrote(stdout: str) -> Path:
    lines = [line for line in stdout.splitlines() if line.startswith("wrote ")]
    assert len(lines) == 1, stdout
    return Path(lines[0][len("wrote "):])


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files (one file, or a Hugging Face dir's shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _order(directory: Path) -> list[str]:
    """The tensors of model.safetensors in the file's own order (safe_open lists them sorted)."""
    from loom.models.init_from import read_header

    header = read_header(directory / "model.safetensors")
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def _load_hf(directory: Path) -> tuple[torch.nn.Module, list[str]]:
    """from_pretrained, and every warning transformers logged while loading."""
    from transformers import AutoModelForCausalLM

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    finally:
        logger.removeHandler(handler)
    return model, records


# ----------------------------------------------------------------------------- a run dir made here


def _fake_run(root: Path, model: str = "llama_tiny", steps: tuple[int, ...] = (2, 4),
              reshape: str | None = None, *overrides: str) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run dir as `loom train` leaves a killed single-process run: the frozen config.yaml and
    Lightning-layout checkpoints (`state_dict` of the LightningModule: `model.<name>`) holding
    distinct weights per step, no final weights; `reshape`: one name saved with a wrong shape."""
    from loom.models import build_module
    from loom.pipeline import resolve
    from loom.rundir.config_file import frozen_yaml

    cfg = resolve([f"model={model}", *ONE_CPU, "run.id=fake", *overrides])
    run = root / "fake"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(frozen_yaml(cfg))
    module = build_module(cfg)
    module.configure_model()
    saved = {}
    for step in steps:
        torch.manual_seed(step)
        state = {k: v + torch.randn_like(v) if v.is_floating_point() else v for k, v in module.model.state_dict().items()}
        saved[step] = state
        ckpt = {f"model.{k}": v for k, v in state.items()}
        if reshape:
            ckpt[f"model.{reshape}"] = ckpt[f"model.{reshape}"][:-1]
        torch.save({"state_dict": ckpt, "global_step": step}, run / "checkpoints" / f"step-{step:07d}.ckpt")
    return run, saved


def test_a_request_export_cannot_serve_is_refused_without_torch(tmp_path):
    """Each refusal: exit 2, one paragraph naming the argument, its value and the choices, before
    torch is imported (the CLI's first second)."""
    run, _ = _fake_run(tmp_path / "llama")
    gpt, _ = _fake_run(tmp_path / "gpt", model="gpt_tiny", steps=())
    empty, _ = _fake_run(tmp_path / "empty", steps=())
    cases = {
        "not a run dir": ([str(tmp_path / "nowhere"), "--format", "loom"], ["nowhere", "not a run dir"]),
        "format": ([str(run), "--format", "onnx"], ["--format onnx", "valid choices: hf:", "peft:", "loom:"]),
        "peft": ([str(run), "--format", "peft"], ["--format peft", "model.lora.r=0", "use --format hf"]),
        "step": ([str(run), "--format", "loom", "--step", "3"], ["--step 3", "available steps: 2, 4"]),
        "no hf": ([str(gpt), "--format", "hf"], ["model=gpt_tiny has no Hugging Face architecture", "llama*",
                                                  "use --format loom"]),
        "nothing": ([str(empty), "--format", "loom"], ["no final weights and no complete checkpoint"]),
        "final": ([str(run), "--format", "loom", "--out", str(run / "final")], ["final/ is the run's own record"]),
        "dtype": ([str(run), "--format", "loom", "--dtype", "int8"], ["--dtype int8", "fp32, bf16, fp16"]),
    }
    assert_refused_without_torch('export', cases, ROOT)


def test_a_checkpoint_exports_under_the_networks_names_in_its_order(tmp_path):
    """The newest checkpoint by default, `--step` another; the network's names in its
    state_dict's order (the checkpoint's `model.` prefix gone), the values of that step, cast to
    `--dtype`; the output under <run>/export/ (final/ never written)."""
    run, saved = _fake_run(tmp_path)
    rc, out, err = _loom("export", str(run), "--format", "loom")
    assert rc == 0, err
    newest = _wrote(out)
    assert newest == run / "export" / "loom-step-4" and not (run / "final").exists()
    assert _order(newest) == list(saved[4])  # the network's own state_dict order
    got = load_file(newest / "model.safetensors")
    assert all(torch.equal(got[k], saved[4][k]) for k in saved[4])
    with safe_open(str(newest / "model.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "4" and f.metadata()["source"] == "checkpoints/step-0000004.ckpt"

    rc, out, err = _loom("export", str(run), "--format", "hf", "--step", "2", "--dtype", "bf16",
                         "--out", str(tmp_path / "hf2"))
    assert rc == 0, err
    hf = _wrote(out)
    assert hf == tmp_path / "hf2"
    config = json.loads((hf / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    got = _tensors(hf)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert torch.equal(got["model.norm.weight"], saved[2]["model.norm.weight"].to(torch.bfloat16))


def test_a_wider_dtype_than_final_holds_is_read_from_the_final_steps_checkpoint(tmp_path):
    """A completed run that exported bf16 final weights: its export defaults to final/, but an
    fp32 export reads the final step's checkpoint (fp32, what training held), not final/'s bf16
    values widened."""
    from loom.rundir.checkpoints import write_final_weights
    from loom.rundir.safetensors_stream import dtype_name

    run, saved = _fake_run(tmp_path, "llama_tiny", (2, 4), None, "checkpoint.export_dtype=bf16")
    bf16 = {k: v.to(torch.bfloat16) for k, v in saved[4].items()}
    write_final_weights(run, [(k, tuple(v.shape), dtype_name(v.dtype)) for k, v in bf16.items()], bf16.items(), {})
    (run / "summary.json").write_text(json.dumps({"status": "completed", "global_step": 4,
                                                  "final_weights": "final/model.safetensors"}))
    rc, out, err = _loom("export", str(run), "--format", "loom")
    assert rc == 0 and "final/model.safetensors (step 4)" in out, err + out
    assert all(torch.equal(v, bf16[k]) for k, v in load_file(_wrote(out) / "model.safetensors").items())
    rc, out, err = _loom("export", str(run), "--format", "loom", "--dtype", "fp32")
    assert rc == 0 and "checkpoints/step-0000004.ckpt (step 4)" in out, err + out
    assert _wrote(out) == run / "export" / "loom-step-4-fp32"
    got = load_file(_wrote(out) / "model.safetensors")
    assert all(torch.equal(got[k], saved[4][k]) for k in saved[4])


def test_weights_of_another_model_are_refused_naming_the_tensor(tmp_path):
    run, _ = _fake_run(tmp_path, steps=(2,), reshape="model.layers.0.mlp.up_proj.weight")
    rc, _, err = _loom("export", str(run), "--format", "loom")
    assert rc == 2 and "Traceback" not in err, err
    assert "'model.model.layers.0.mlp.up_proj.weight' with shape [383, 128]" in err and "[384, 128]" in err, err
    assert not (run / "export").exists()


# ----------------------------------------------------------------------------- the shared Llama runs

KEPT = ("ddp", "fsdp", "zero3")  # the Llama runs that keep their checkpoints (steps 5 and 10)


@launching_fixture(scope="module")
def kept_runs(shared) -> dict:
    """ddp, fsdp and zero3 of tests/test_llama_runs.py: the same arguments, so the same runs."""
    return completed_llama_runs(shared, KEPT)


def _steps(run_dir: Path) -> list[int]:
    from loom.rundir.checkpoints import complete_checkpoints, step_of

    return sorted(step_of(p) for p in complete_checkpoints(run_dir))


def test_export_of_a_finished_fsdp_run_loads_with_from_pretrained(kept_runs):
    """The DCP checkpoint of the final step, exported as a Hugging Face directory (sharded at the
    run's checkpoint.export_shard_gb, with its index), loads with from_pretrained without a config
    warning and holds exactly the weights training's own hf export wrote to final/; the default
    source of a finished run (final/) exports the same; a step without a checkpoint exits 2
    naming those there are."""
    run = kept_runs["fsdp"].run_dir
    assert _steps(run) == [5, 10]
    rc, out, err = _loom("export", str(run), "--format", "hf", "--step", "10")
    assert rc == 0, err
    exported = _wrote(out)
    assert exported == run / "export" / "hf-step-10"
    assert (exported / "model.safetensors.index.json").is_file() and len(list(exported.glob("*.safetensors"))) > 3
    model, warnings = _load_hf(exported)
    assert not [w for w in warnings if "must be" in w], warnings
    final = _tensors(run / "final")
    got = _tensors(exported)
    assert set(got) == set(final)
    assert all(torch.equal(got[k], final[k]) for k in final)
    trained, _ = _load_hf(run / "final")
    x = torch.randint(0, HF_SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x).logits, trained(x).logits)

    rc, out, err = _loom("export", str(run), "--format", "loom")  # no --step: final/ (an hf dir here)
    assert rc == 0, err
    assert "final (step 10)" in out and _wrote(out) == run / "export" / "loom-step-10"
    got = load_file(run / "export" / "loom-step-10" / "model.safetensors")
    assert set(got) == set(final) and all(torch.equal(got[k], final[k]) for k in final)

    rc, _, err = _loom("export", str(run), "--format", "hf", "--step", "7")
    assert rc == 2 and "available steps: 5, 10" in err and "Traceback" not in err, err


@pytest.mark.parametrize("strategy,fmt", [("ddp", "loom"), ("zero3", "hf")])
def test_the_final_steps_checkpoint_exports_what_training_exported(kept_runs, strategy, fmt):
    """ddp's Lightning .ckpt and zero3's ZeRO directory (fp32 masters rebuilt from both ranks'
    partitions by DeepSpeed's zero_to_fp32) of step 10 hold final/model.safetensors exactly."""
    run = kept_runs[strategy].run_dir
    assert _steps(run) == [5, 10]
    rc, out, err = _loom("export", str(run), "--format", fmt, "--step", "10")
    assert rc == 0, err
    final, got = load_file(run / "final" / "model.safetensors"), _tensors(_wrote(out))
    assert set(got) == set(final)
    assert all(torch.equal(got[k], final[k]) for k in final), [k for k in final if not torch.equal(got[k], final[k])]
    if fmt == "hf":
        _load_hf(_wrote(out))


def test_step_5_is_the_same_weights_from_every_kind_of_checkpoint(kept_runs):
    """The same 5 steps trained under ddp, fsdp and zero3 (the parity tests hold their losses
    within 1e-5 of each other): their step-5 checkpoints, read by three different readers, export
    the same weights, and weights other than step 10's (a reader that returned another step, or
    one rank's shard in place of the whole tensor, fails here)."""
    exports = {}
    for strategy in KEPT:
        out_dir = kept_runs[strategy].run_dir / "export" / "step5"
        rc, out, err = _loom("export", str(kept_runs[strategy].run_dir), "--format", "loom", "--step", "5",
                             "--out", str(out_dir))
        assert rc == 0, err
        exports[strategy] = load_file(out_dir / "model.safetensors")
    ddp, final = exports["ddp"], load_file(kept_runs["ddp"].run_dir / "final" / "model.safetensors")
    for strategy in ("fsdp", "zero3"):
        assert list(exports[strategy]) == list(ddp)
        worst = max(float((exports[strategy][k] - ddp[k]).abs().max()) for k in ddp)
        assert worst < 1e-5, (strategy, worst)  # measured: 8.4e-8
    moved = max(float((final[k] - ddp[k]).abs().max()) for k in ddp)
    assert moved > 1e-3, moved  # measured: 4.0e-3


def test_a_completed_run_asked_for_hf_names_the_export_command_and_it_works(kept_runs, shared):
    """`loom train <ddp's overrides> checkpoint.export_format=hf` on the completed ddp run trains
    nothing and prints the `loom export` command; that command, run as printed, writes a
    Hugging Face directory that loads without a warning about config.json's fields."""
    from loom import pipeline

    run = kept_runs["ddp"].run_dir
    root = run.parent.parent

    def no_launch(*_a, **_k):
        raise AssertionError("a completed run was launched again")

    saved, pipeline.launch = pipeline.launch, no_launch
    sys.path.insert(0, str(root))
    try:
        rc, out, err = _loom("train", *llama_args(shared, "ddp"), "checkpoint.export_format=hf", f"run.root={root}",
                             cwd=root)
    finally:
        pipeline.launch = saved
        sys.path.remove(str(root))
    assert rc == 0, err
    assert "checkpoint.export_format=loom" in out and "Nothing to train" in out, out
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("loom export "))
    assert command == f"loom export {shlex.quote(str(run))} --format hf", out
    rc, out, err = _loom(*shlex.split(command)[1:])
    assert rc == 0, err
    exported = _wrote(out)
    assert exported == run / "export" / "hf-step-10" and (exported / "config.json").is_file()
    _, warnings = _load_hf(exported)
    assert not [w for w in warnings if "must be" in w], warnings
    assert (run / "final" / "model.safetensors").is_file() and not (run / "final" / "config.json").exists()


# ----------------------------------------------------------------------------- the nd pipeline run


@pytest.mark.launch
@pytest.mark.slow
def test_a_pipeline_runs_checkpoint_exports_what_training_exported(shared):
    """nd (dp_shard 2, pp 2): each stage wrote its own layers' DCP shards; the export of step 10
    holds final/model.safetensors exactly, in its order; gpt_tiny has no Hugging Face form."""
    from test_nd import _nd

    run = _nd("dp2_pp2", shared).run_dir
    rc, out, err = _loom("export", str(run), "--format", "loom", "--step", "10", "--out", str(run / "export" / "s10"))
    assert rc == 0, err
    final = load_file(run / "final" / "model.safetensors")
    got = load_file(run / "export" / "s10" / "model.safetensors")
    assert _order(run / "export" / "s10") == _order(run / "final")
    assert all(torch.equal(got[k], final[k]) for k in final)
    rc, _, err = _loom("export", str(run), "--format", "hf")
    assert rc == 2 and "model=gpt_tiny has no Hugging Face architecture" in err, err
