"""Hardware profiles: shipped numbers, validation refusals (exit 2, key named, no run dir),
`auto` resolution, the machine check, SLURM's clear refusal, and `loom probe`."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import LOOM, ROOT
from omegaconf import OmegaConf

from loom.compose import group_options
from loom.errors import ConfigError
from loom.hardware import machine as hardware
from loom.pipeline import resolve
from loom.plan import make_plan

PROFILES = group_options("hardware")


def _runs(root):
    return [p for p in root.rglob("*") if p.name in ("config.yaml", "plan.json")]


# ------------------------------------------------------------------ the shipped profiles


def test_the_shipped_profiles_are_the_ones_the_readme_lists():
    """docs/reference.md's config-group table names the hardware options; the conf files must be exactly those
    (a profile added or dropped without the table, or the table without the file, fails)."""
    row = next(line for line in (ROOT / "docs" / "reference.md").read_text().splitlines() if line.startswith("| hardware |"))
    listed = row.split("|")[2].split("(")[0].replace(" ", "").strip(",").split(",")
    assert sorted(PROFILES) == sorted(listed), (PROFILES, listed)


@pytest.mark.parametrize("name", [p for p in PROFILES if p != "auto"])
def test_every_profile_validates_and_plans(name):
    extra = ["hardware.rdzv_endpoint=node0:29500"] if name == "multinode" else []
    cfg = resolve([f"hardware={name}", *extra])
    hw = cfg.hardware
    assert hw.name == name
    assert hw.backend == ("nccl" if hw.accelerator == "gpu" else "gloo")
    plan = make_plan(cfg)  # the plan reads the profile's world and its peak for the run's precision
    assert plan.world_size == hw.devices * hw.num_nodes and plan.precision == hw.precision
    key = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "fp32"}[hw.precision]
    peak = hw.peak_tflops.get(key)
    assert plan.peak_flops_per_device == (None if peak is None else pytest.approx(peak * 1e12)), (key, peak)
    if hw.peak_tflops.get("fp32") is not None:  # the same profile at fp32: TF32 on a GPU, else fp32
        fp32 = make_plan(resolve([f"hardware={name}", *extra, "hardware.precision=32-true"]))
        tf32 = hw.accelerator == "gpu" and hw.peak_tflops.get("tf32")
        assert fp32.peak_flops_per_device == pytest.approx((tf32 or hw.peak_tflops.fp32) * 1e12)
        strict = make_plan(resolve([f"hardware={name}", *extra, "hardware.precision=32-true", "hardware.tf32=false"]))
        assert strict.peak_flops_per_device == pytest.approx(hw.peak_tflops.fp32 * 1e12)


@pytest.mark.parametrize(("name", "memory", "bf16", "fp32", "tf32"), [
    ("a100x8", 80, 312.0, 19.5, 156.0),
    ("h100x8", 80, 989.4, 66.9, 494.7),
    ("h200x8", 141, 989.4, 66.9, 494.7),
])
def test_datasheet_numbers(name, memory, bf16, fp32, tf32):
    hw = resolve([f"hardware={name}"]).hardware
    assert (hw.devices, hw.num_nodes, hw.device_memory_gb) == (8, 1, memory)
    assert (hw.peak_tflops.bf16, hw.peak_tflops.fp32, hw.peak_tflops.tf32) == (bf16, fp32, tf32)
    assert hw.precision == "bf16-mixed" and hw.bf16_supported
    assert "nvlink" in hw.interconnect and hw.pin_memory


def test_generic_gpu_has_unknown_peak():
    cfg = resolve(["hardware=gpu"])
    assert all(v is None for v in cfg.hardware.peak_tflops.values())
    assert make_plan(resolve(["hardware=gpu", "hardware.peak_tflops.bf16=100"])).peak_flops_per_device == 1e14
    plan = make_plan(cfg)
    assert plan.peak_flops_per_device is None
    assert any("MFU will be null" in w for w in plan.warnings)


def test_cpu_profile_runs_fp32_over_gloo():
    hw = resolve(["hardware=cpu"]).hardware
    assert (hw.accelerator, hw.precision, hw.backend) == ("cpu", "32-true", "gloo")


# ------------------------------------------------------------------ validation refusals


@pytest.mark.parametrize(("overrides", "key"), [
    (["hardware=cpu", "hardware.devices=0"], "hardware.devices"),
    (["hardware=h100x8", "hardware.num_nodes=0"], "hardware.num_nodes"),
    (["hardware=multinode"], "hardware.rdzv_endpoint"),
    (["hardware=multinode", "hardware.rdzv_endpoint=node0"], "hardware.rdzv_endpoint"),
    (["hardware=gpu", "hardware.bf16_supported=false"], "hardware.precision"),
    (["hardware=cpu", "hardware.backend=nccl"], "hardware.backend"),
    (["hardware=cpu", "hardware.backend=mpi"], "hardware.backend"),
    (["hardware=h100x8", "+hardware.peak_tflops.fp8=1979"], "hardware.peak_tflops.fp8"),
    (["hardware=slurm", "hardware.slurm.time_limit=soon"], "hardware.slurm.time_limit"),
    (["hardware=slurm", "hardware.slurm.gpus_per_node=4"], "hardware.slurm.gpus_per_node"),
    (["hardware=cpu", "hardware.launcher=slurm"], "hardware.slurm"),
])
def test_invalid_profile_refused(overrides, key):
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_bf16_gpu_without_it_accepts_16_mixed():
    cfg = resolve(["hardware=gpu", "hardware.bf16_supported=false", "hardware.precision=16-mixed"])
    assert cfg.hardware.precision == "16-mixed"


def _cli(tmp_path, *args):
    return subprocess.run([*LOOM, *args, f"run.root={tmp_path}"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


def test_unknown_profile_lists_choices(tmp_path):
    p = _cli(tmp_path, "train", "hardware=tpu_v9")
    assert p.returncode == 2
    assert "hardware=tpu_v9" in p.stderr and "h100x8" in p.stderr and "cpu" in p.stderr
    assert "Traceback" not in p.stderr
    assert not _runs(tmp_path)


@pytest.mark.parametrize(("args", "needle"), [
    (["hardware=cpu", "hardware.devices=0"], "hardware.devices=0"),
    (["hardware=multinode"], "hardware.rdzv_endpoint"),
    (["hardware=gpu", "hardware.bf16_supported=false"], "hardware.precision='bf16-mixed'"),
])
def test_cli_refusals_exit_2_without_run_dir(tmp_path, args, needle):
    for verb in ("train", "plan"):
        p = _cli(tmp_path, verb, *args)
        assert p.returncode == 2, (verb, p.stderr)
        assert needle in p.stderr and "Traceback" not in p.stderr
    assert not _runs(tmp_path)


@pytest.mark.skipif(hardware.visible_gpus() > 0, reason="this machine has GPUs")
def test_gpu_profile_refused_for_train_on_cpu_machine_but_plans(tmp_path):
    p = _cli(tmp_path, "train", "hardware=h100x8", "model=gpt_7b", "strategy=zero3")
    assert p.returncode == 2 and "hardware=h100x8" in p.stderr and "needs CUDA GPUs" in p.stderr
    assert not _runs(tmp_path)
    p = _cli(tmp_path, "plan", "hardware=h100x8", "model=gpt_7b", "strategy=zero3")
    assert p.returncode == 0, p.stderr


def test_slurm_plans_and_train_without_sbatch_refuses_clearly(tmp_path):
    p = _cli(tmp_path, "plan", "hardware=slurm", "strategy=zero2")
    assert p.returncode == 0, p.stderr
    assert "16 (2 node(s) x 8)" in p.stdout
    p = _cli(tmp_path, "train", "hardware=slurm", "strategy=zero2")  # no sbatch here (tests/test_slurm.py)
    assert p.returncode == 2
    assert "sbatch" in p.stderr and "--dry-run" in p.stderr and "hardware.launcher=slurm" in p.stderr
    assert not _runs(tmp_path)


# ------------------------------------------------------------------ auto and the machine


def test_auto_resolves_to_cpu_here_and_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(0))
    cfg = resolve([])
    assert (cfg.hardware.name, cfg.hardware.resolved_from) == ("cpu", "auto")
    p = _cli(tmp_path, "train", "--cfg", "job")  # the child sees this machine's GPUs, not the patch
    assert p.returncode == 0, p.stderr
    frozen = OmegaConf.create(p.stdout)
    expected = "cpu" if hardware.visible_gpus() == 0 else "gpu-profile"
    got = frozen.hardware.name if frozen.hardware.name == "cpu" else "gpu-profile"
    assert (got, frozen.hardware.resolved_from) == (expected, "auto")


def test_auto_picks_a_known_gpu_profile(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(4, "NVIDIA H100 80GB HBM3", 85.0))
    hw = resolve(["hardware=auto"]).hardware
    assert (hw.name, hw.devices, hw.resolved_from) == ("h100x8", 4, "auto")
    assert hw.peak_tflops.bf16 == 989.4


def test_auto_unknown_gpu_gets_nvml_name_and_memory_but_no_peak(monkeypatch):
    info = hardware.GpuInfo(2, "NVIDIA RTX 6000 Ada Generation", 51.5, (8, 9))
    monkeypatch.setattr(hardware, "gpu_info", lambda: info)
    cfg = resolve([])
    hw = cfg.hardware
    assert (hw.name, hw.devices, hw.device_name, hw.device_memory_gb) == ("gpu", 2, info.name, 51.5)
    assert hw.precision == "bf16-mixed"
    assert make_plan(cfg).peak_flops_per_device is None


def test_auto_gpu_of_the_peak_table_gets_its_datasheet_peaks(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(2, "NVIDIA H100 PCIe", 85.5, (9, 0)))
    cfg = resolve([])
    assert (cfg.hardware.name, cfg.hardware.devices, cfg.hardware.precision) == ("gpu", 2, "bf16-mixed")
    assert dict(cfg.hardware.peak_tflops) == {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2, "fp8": 1513.0}
    assert make_plan(cfg).peak_flops_per_device == pytest.approx(756.5e12)


@pytest.mark.parametrize(("name", "cc"), [("Tesla V100-SXM2-32GB", (7, 0)), ("Tesla T4", (7, 5)),
                                          ("NVIDIA H100 80GB HBM3", (7, 0)), ("Some GPU", None)])
def test_auto_never_picks_bf16_without_it(name, cc):
    over = hardware.overrides_for(hardware.GpuInfo(4, name, 16.0, cc), [])
    assert "hardware=gpu" in over  # not a bf16 profile, even under a known profile's name
    assert "hardware.bf16_supported=false" in over and "hardware.precision=16-mixed" in over
    assert not any(o.startswith("hardware.peak_tflops") for o in over)  # cc disagrees: no row
    hw = resolve(over).hardware  # and the config it resolves to trains in fp16, validated
    assert (hw.name, hw.precision, hw.bf16_supported, hw.devices) == ("gpu", "16-mixed", False, 4)


def test_auto_strategy_single_uses_one_device(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(8, "NVIDIA H200", 150.0, (9, 0)))
    hw = resolve(["strategy=single"]).hardware
    assert (hw.name, hw.devices) == ("h200x8", 1)
    assert resolve(["strategy=ddp"]).hardware.devices == 8
    assert resolve(["strategy=single", "hardware=auto"]).hardware.devices == 1
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(4, "NVIDIA L40S", 48.0, (8, 9)))
    assert resolve(["strategy=single"]).hardware.devices == 1


def test_peak_table_by_name_and_compute_capability():
    from loom.hardware.peaks import GPU_PEAKS, bf16_capable, lookup

    assert lookup("NVIDIA H100 80GB HBM3", (9, 0)).bf16 == 989.4
    assert lookup("NVIDIA H100 NVL", (9, 0)).bf16 == 835.5
    assert lookup("NVIDIA H800 PCIe", (9, 0)).tf32 == 378.0
    assert lookup("NVIDIA GH200 480GB", (9, 0)).fp32 == 67.0
    assert lookup("NVIDIA A100-SXM4-40GB", (8, 0)).memory_gb == 40
    assert lookup("NVIDIA A100 80GB PCIe", (8, 0)).bf16 == 312.0
    assert lookup("NVIDIA L40S", (8, 9)).bf16 == 362.05
    assert lookup("NVIDIA A10G", (8, 6)).fp16 == 125.0
    assert lookup("NVIDIA GeForce RTX 4090", (8, 9)).bf16 == 165.2
    assert lookup("NVIDIA B200", (10, 0)).bf16 == 2250.0
    assert lookup("NVIDIA H200", None).bf16 == 989.4
    assert lookup("NVIDIA H200", (8, 0)) is None  # the name says Hopper, the device does not
    assert lookup("NVIDIA H100", (9, 0)) is None  # no prefix matching: PCIe vs SXM differ by 30%
    assert lookup(None) is None
    for row in GPU_PEAKS:  # dense numbers: fp16 >= tf32 >= fp32 / 2 or so, never sparse (2x)
        assert row.bf16 == row.fp16 and row.tf32 <= row.bf16 and row.fp32 <= row.bf16 and row.bf16 < 2500
        assert bf16_capable(row.cc)
    assert not bf16_capable((7, 5)) and not bf16_capable(None) and bf16_capable((8, 0))


def test_auto_user_overrides_still_win(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_info", lambda: hardware.GpuInfo(8, "NVIDIA H200", 150.0))
    hw = resolve(["hardware.devices=2"]).hardware
    assert (hw.name, hw.devices) == ("h200x8", 2)


def test_check_machine(monkeypatch):
    monkeypatch.setattr(hardware, "visible_gpus", lambda: 4)
    hardware.check_machine(resolve(["hardware=h100x8", "hardware.devices=4"]))
    with pytest.raises(ConfigError, match=r"hardware.devices=8 .* has 4 GPU"):
        hardware.check_machine(resolve(["hardware=h100x8"]))
    # every node of a multi-node run checks its own GPUs
    with pytest.raises(ConfigError, match="hardware.devices=8"):
        hardware.check_machine(resolve(["hardware=multinode", "hardware.rdzv_endpoint=n0:29500"]))
    monkeypatch.setattr(hardware, "visible_gpus", lambda: 0)
    with pytest.raises(ConfigError, match="needs CUDA GPUs"):
        hardware.check_machine(resolve(["hardware=gpu"]))
    hardware.check_machine(resolve(["hardware=cpu"]))
    with pytest.raises(ConfigError, match="hardware.devices=64"):
        hardware.check_machine(resolve(["hardware=cpu", "hardware.devices=64"]))


# ------------------------------------------------------------------ loom probe


def test_probe_writes_a_profile_plan_accepts(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    env = {"LOOM_CONF_DIR": str(conf)}
    out = conf / "hardware" / "probe_test.yaml"
    p = subprocess.run([*LOOM, "probe", "--out", str(out), "--repeats", "3", "--allreduce-mb", "8"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    prof = OmegaConf.load(out)
    assert prof.name == "probe_test" and prof.accelerator == ("gpu" if hardware.visible_gpus() else "cpu")
    m = prof.measured
    assert m.matmul_tflops > 0 and m.allreduce_busbw_gbps > 0
    if prof.accelerator == "cpu":
        assert prof.peak_tflops.fp32 == m.matmul_tflops and m.allreduce_backend == "gloo"
        assert "measured" in out.read_text().split("name:")[0]  # the comment says so
    plan_json = tmp_path / "plan.json"
    p = subprocess.run([*LOOM, "plan", "hardware=probe_test", "--json", str(plan_json)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    plan = OmegaConf.load(plan_json)
    if prof.accelerator == "cpu":
        assert plan.peak_flops_per_device == pytest.approx(m.matmul_tflops * 1e12)
        assert plan.comm_time_s_at_measured_busbw is not None


def test_auto_takes_this_hosts_memory_and_cores_not_the_profiles():
    """One H100 in a 251 GB, 16-core host: not h100x8's 2 TB, 112 cores and NVLink; the plan's
    host-memory checks (offload) use the measured figure."""
    gpu = hardware.GpuInfo(1, "NVIDIA H100 80GB HBM3", 85.0, (9, 0))
    cfg = resolve(hardware.overrides_for(gpu, ["strategy=zero3_offload"], hardware.HostInfo(251.5, 16)))
    hw = cfg.hardware
    assert (hw.name, hw.devices, hw.host_memory_gb, hw.cpu_cores) == ("h100x8", 1, 251.5, 16)
    assert hw.interconnect.startswith("none")
    assert make_plan(cfg).host_capacity_bytes == pytest.approx(make_plan(resolve(["hardware=h100x8"])).host_capacity_bytes
                                                               * 251.5 / 2048)
    here = hardware.host_info()  # this machine, measured: the cpu profile gets it too
    assert here.cores == hardware.usable_cores() and here.memory_gb and 0.1 < here.memory_gb < 100_000
    cpu = resolve(hardware.overrides_for(hardware.GpuInfo(0), [], here)).hardware
    assert (cpu.name, cpu.host_memory_gb, cpu.cpu_cores) == ("cpu", here.memory_gb, here.cores)


def test_auto_nvml_failure_counts_gpus_with_torch_and_warns(monkeypatch, capsys):
    """An NVML error after init (a MIG device, an unknown UUID) must not become a silent CPU run."""
    import pynvml
    import torch

    def refuse(*_):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = hardware.gpu_info()
    assert (info.count, info.name) == (2, None)
    err = capsys.readouterr().err
    assert "NVML could not describe the GPUs" in err and "torch.cuda sees 2" in err
    hw = resolve(hardware.overrides_for(info, [])).hardware
    assert (hw.name, hw.accelerator, hw.devices, hw.precision) == ("gpu", "gpu", 2, "16-mixed")


def test_tf32_is_the_default_fp32_peak_on_gpus():
    """hardware.tf32 (default true): fp32 runs on an H100 compute at the TF32 peak, and MFU is
    against it; off, against fp32's; the CPU has no TF32."""
    on = make_plan(resolve(["hardware=h100x8", "hardware.precision=32-true"]))
    off = make_plan(resolve(["hardware=h100x8", "hardware.precision=32-true", "hardware.tf32=false"]))
    assert (on.peak_flops_per_device, off.peak_flops_per_device) == (pytest.approx(494.7e12), pytest.approx(66.9e12))
    assert make_plan(resolve(["hardware=h100x8"])).peak_flops_per_device == pytest.approx(989.4e12)  # bf16
    cpu = resolve(["hardware=cpu", "hardware.peak_tflops.fp32=1.0", "hardware.peak_tflops.tf32=2.0"])
    assert make_plan(cpu).peak_flops_per_device == pytest.approx(1.0e12)


def test_probe_refuses_an_unwritable_profile_before_measuring(tmp_path):
    """An installed Loom's config folder may be read-only (site-packages on an image): the probe
    says so and how to write elsewhere, before spending its measurement (no traceback)."""
    from loom.errors import ConfigError
    from loom.probe import probe

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"cannot write .*a-file/hw/p\.yaml \(--out; .*pass --out FILE\.yaml"):
        probe(out=str(blocker / "hw" / "p.yaml"))
