"""float8's torch-free half (issue 56): the checks that refuse it before launch, the datasheet's float8 peaks,
and what the plan makes of it (MFU's basis beside the bf16 peak, the step's compute rate, FSDP2's float8
all-gather on the wire, the transient casts, the warnings). In-process, nothing launched; the conversion
itself, its CPU emulation and the GPU runs are tests/ of the torch half."""

from __future__ import annotations

import contextlib
import io

import pytest

from loom import cli
from loom.errors import ConfigError
from loom.hardware.peaks import lookup
from loom.pipeline import resolve
from loom.plan import make_plan
from loom.plan.float8 import compute_speedup

LLAMA_H100 = ("model=llama3_8b", "strategy=fsdp", "hardware=h100x8", "trainer.compile=true")
TiB = 1e12


def _plan(*overrides: str):
    return make_plan(resolve(list(overrides)))


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(list(overrides))
    return str(e.value)


@pytest.fixture(scope="module")
def llama_pair():
    """Llama 3 8B, FSDP over 8 H100s with compile: float8=tensorwise and float8=none."""
    return _plan(*LLAMA_H100, "float8=tensorwise"), _plan(*LLAMA_H100, "float8=none")


def test_datasheet_float8_peaks():
    assert lookup("NVIDIA H100 80GB HBM3").fp8 == 1978.9 and lookup("NVIDIA H200").fp8 == 1978.9
    assert lookup("NVIDIA H100 PCIe").fp8 == 1513.0 and lookup("NVIDIA H100 NVL").fp8 == 1670.5
    assert lookup("NVIDIA L40S").fp8 == 733.0 and lookup("NVIDIA B200").mxfp8 == 4500.0
    a100 = lookup("NVIDIA A100-SXM4-80GB")
    assert a100.fp8 is None and "fp8" not in a100.tflops()  # `loom probe` / hardware=auto write no null key
    assert lookup("NVIDIA H100 80GB HBM3").tflops()["fp8"] == 1978.9


def test_h100_plan_measures_mfu_against_the_float8_peak_and_keeps_the_bf16_one(llama_pair):
    f8, none = llama_pair
    assert f8.peak_flops_per_device == pytest.approx(1978.9 * TiB)
    assert f8.peak_flops_per_device_bf16 == pytest.approx(989.4 * TiB)
    assert f8.peak_precision == "fp8" and none.peak_precision == "bf16"
    assert none.peak_flops_per_device == pytest.approx(989.4 * TiB) and none.peak_flops_per_device_bf16 is None
    assert none.float8 is None
    s = f8.float8
    assert (s["recipe"], s["emulated"], s["all_gather"], s["peak_precision"]) == ("tensorwise", False, True, "fp8")
    # every matmul parameter but the untied head (128,256 x 4,096) is converted
    assert s["converted_params"] == f8.non_embedding_params - 128256 * 4096 == pytest.approx(6.98e9, rel=0.01)
    assert 0.5 < s["flops_share"] < 1.0
    assert s["compute_speedup"] == pytest.approx(compute_speedup(s["flops_share"], 1978.9, 989.4))
    assert 1.0 < s["compute_speedup"] < 2.0
    assert not any("trainer.compile" in w for w in f8.warnings)


def test_float8_all_gather_halves_the_converted_weights_on_the_wire(llama_pair):
    f8, none = llama_pair
    share = f8.float8["converted_params"] / f8.params
    gather, base = f8.comm_bytes_by_collective["all_gather"], none.comm_bytes_by_collective["all_gather"]
    assert gather == pytest.approx(base * (1 - share / 2))  # 1 byte instead of bf16's 2 for the converted share
    assert f8.comm_bytes_by_collective["reduce_scatter"] == none.comm_bytes_by_collective["reduce_scatter"]
    off = _plan(*LLAMA_H100, "float8=tensorwise", "float8.all_gather=false")
    assert off.float8["all_gather"] is False
    assert off.comm_bytes_by_collective["all_gather"] == pytest.approx(base)


def test_the_transient_float8_casts_count_in_memory(llama_pair):
    f8, none = llama_pair
    cast = f8.float8["cast_bytes_per_device"]
    assert cast == pytest.approx(f8.float8["converted_params"] / 32)  # one block's weights at 1 byte
    assert f8.memory_per_device_bytes["float8_cast"] == cast
    assert f8.memory_per_device_bytes["total"] == pytest.approx(none.memory_per_device_bytes["total"] + cast)


def test_the_table_shows_the_basis_and_the_float8_row(llama_pair, capsys, monkeypatch):
    from loom.plan.render import render

    monkeypatch.setenv("COLUMNS", "400")  # one line per row
    render(llama_pair[0].to_dict())
    out = " ".join(capsys.readouterr().out.split())
    assert "1,978.9 TFLOP/s per device (fp8: MFU's basis)" in out and "989.4 TFLOP/s beside it" in out
    assert "tensorwise, real float8 matmuls" in out and "1 byte/param" in out


def test_no_compile_on_a_gpu_is_a_warning():
    plan = _plan("model=llama3_8b", "strategy=fsdp", "hardware=h100x8", "trainer.compile=false", "float8=rowwise")
    (warning,) = [w for w in plan.warnings if "trainer.compile" in w]
    assert "torchtitan #1191" in warning and "trainer.compile=true" in warning


def test_emulated_on_a_gpu_warns_and_measures_against_bf16():
    plan = _plan(*LLAMA_H100, "float8=tensorwise", "float8.emulate=true")
    assert plan.float8["emulated"] and plan.peak_precision == "bf16"
    assert plan.peak_flops_per_device == pytest.approx(989.4 * TiB) and plan.float8["compute_speedup"] == 1.0
    assert any("no speedup" in w for w in plan.warnings)


def test_cpu_is_emulated_and_all_gather_without_fsdp_is_ignored(capsys):
    plan = _plan("hardware=cpu", "strategy=ddp", "float8=tensorwise")
    assert plan.float8["emulated"] and plan.float8["all_gather"] is False
    assert any("float8.all_gather=true has no effect with strategy=ddp" in w for w in plan.warnings)
    assert not any("trainer.compile" in w for w in plan.warnings)
    fsdp = _plan("hardware=cpu", "strategy=fsdp", "float8=tensorwise")
    assert fsdp.float8["all_gather"] is True and not any("all_gather" in w for w in fsdp.warnings)
    from loom.plan.render import render

    render(plan.to_dict())
    assert "emulated" in capsys.readouterr().out


def test_a100_is_refused_naming_the_gpu():
    msg = _refusal("model=llama3_8b", "hardware=a100x8", "float8=tensorwise")
    assert "NVIDIA A100-SXM4-80GB" in msg and "compute capability 8.0" in msg and "8.9+" in msg
    assert "float8=none" in msg and "float8.emulate=true" in msg and "hardware=h100x8" in msg
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["plan", "model=llama3_8b", "hardware=a100x8", "float8=tensorwise"]) == 2
    assert "NVIDIA A100-SXM4-80GB" in err.getvalue()


def test_mxfp8_needs_blackwell():
    msg = _refusal(*LLAMA_H100, "float8=mxfp8")
    assert "MXFP8" in msg and "10.0+" in msg and "float8=tensorwise" in msg and "NVIDIA H100 80GB HBM3" in msg
    assert _plan("hardware=cpu", "strategy=single", "float8=mxfp8").float8["emulated"]  # emulated on CPU


def test_an_unknown_gpu_needs_its_float8_peak():
    msg = _refusal("hardware=gpu", "strategy=single", "float8=tensorwise")
    assert "hardware.peak_tflops.fp8" in msg and "unknown GPU" in msg
    plan = _plan("hardware=gpu", "strategy=single", "float8=tensorwise", "hardware.peak_tflops.fp8=500",
                 "hardware.peak_tflops.bf16=250", "trainer.compile=true")
    assert plan.peak_flops_per_device == pytest.approx(500 * TiB) and plan.peak_flops_per_device_bf16 == 250 * TiB


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_deepspeed_zero_is_refused(strategy):
    msg = _refusal("hardware=cpu", f"strategy={strategy}", "float8=tensorwise")
    assert f"strategy={strategy}" in msg and "ZeRO flattens the parameters" in msg and "Float8Linear" in msg
    assert "strategy=single, ddp or fsdp" in msg and "float8=none" in msg


def test_pipelines_and_tensor_parallelism_are_refused():
    pp = _refusal("hardware=cpu", "hardware.devices=2", "strategy=pp", "model=llama_tiny", "model.tie_embeddings=false",
                  "float8=rowwise")
    assert "float8=rowwise with strategy=pp: pp=2: pipeline stages" in pp and "float8=none" in pp
    tp = _refusal("hardware=cpu", "hardware.devices=2", "strategy=fsdp_tp", "model=llama_tiny", "float8=rowwise")
    assert "float8=rowwise with strategy=fsdp_tp: tp=2" in tp and "not built yet" in tp


def test_all_gather_needs_tensorwise():
    msg = _refusal("hardware=cpu", "strategy=fsdp", "float8=rowwise", "float8.all_gather=true")
    assert "float8.all_gather=false" in msg and "tensorwise" in msg and "torchao asserts" in msg


def test_compare_lists_the_layouts_that_carry_float8():
    from loom.compose import compose
    from loom.plan.compare import compare

    result = compare(compose(["model=llama3_8b", "hardware=h100x8", "float8=tensorwise", "trainer.compile=true"]))
    assert {c.strategy for c in result.candidates} <= {"single", "ddp", "fsdp", "nd"}
    assert all(c.to_dict()["float8"] == "tensorwise" for c in result.candidates)
    assert any("ZeRO" in why for _, why in result.refused)


def test_summary_rates_carry_the_bf16_peak_mfu():
    from loom.tracking.trained import rates

    kw = dict(items_per_sample=10, token_data=True, flops_per_token=1e9, world_size=1)
    out = rates(100, 1.0, 2e12, bf16_peak_flops=1e12, peak_precision="fp8", **kw)
    assert out["mfu"] == pytest.approx(0.5) and out["mfu_bf16_peak"] == pytest.approx(1.0)
    assert out["mfu_peak_precision"] == "fp8"
    plain = rates(100, 1.0, 2e12, peak_precision="bf16", **kw)
    assert plain["mfu_bf16_peak"] is None and plain["mfu_peak_precision"] == "bf16"
