"""This machine: resolve `hardware=auto` and check a profile against what is here.

Runs in the launcher before torch is imported, so GPUs are counted through NVML
(nvidia-ml-py), which answers in milliseconds, not through torch.cuda.

Two kinds of check live in two places: a profile's own consistency (backend, precision,
rendezvous, SLURM fields) is `loom.hardware.checks`, run for every verb; whether *this*
machine can run it is `check_machine` here, run by `loom train` only, so `loom plan
hardware=h100x8` works on a laptop.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.hardware.nvml import visible_count, visible_entry
from loom.hardware.peaks import bf16_capable, lookup
from loom.hardware.schema import SUBMITTED
from loom.schema import load

# NVML device names whose datasheet numbers a shipped profile holds. Exact names only: an
# H100 PCIe (756 dense bf16) must not borrow the SXM peak. Other devices become `gpu` with the
# peaks of `hardware.peaks.GPU_PEAKS` when their name and compute capability are there, else an
# unknown peak (MFU null) rather than a guessed one.
KNOWN_GPUS = {
    "NVIDIA A100-SXM4-80GB": "a100x8",
    "NVIDIA H100 80GB HBM3": "h100x8",
    "NVIDIA H200": "h200x8",
}


@dataclass
class GpuInfo:
    count: int
    name: str | None = None
    memory_gb: float | None = None
    cc: tuple[int, int] | None = None   # compute capability (major, minor)


@dataclass
class HostInfo:
    memory_gb: float | None   # physical memory, or the cgroup's limit when lower (a container)
    cores: int                 # this process's CPU affinity


def gpu_info() -> GpuInfo:
    """GPUs this process may use (NVML, honouring CUDA_VISIBLE_DEVICES), and the first one's
    name and memory. No NVML library or driver: no GPU. Any other NVML failure (a MIG device,
    a UUID prefix NVML cannot look up) must not quietly turn a GPU machine into a CPU run: the
    count then comes from torch.cuda, with one warning, and the device is unnamed."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # nvidia-ml-py without libnvidia-ml (a CPU machine): no NVIDIA GPU here
        return GpuInfo(0)
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = visible_count(visible, pynvml.nvmlDeviceGetCount())
        if not count:
            return GpuInfo(0)
        handle = _first_visible(pynvml, visible)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        mem = round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 1e9, 1)
        return GpuInfo(count, name, mem, _compute_capability(pynvml, handle))
    except Exception as e:
        return torch_gpu_info(f"{type(e).__name__}: {e}")
    finally:
        pynvml.nvmlShutdown()


def torch_gpu_info(why: str) -> GpuInfo:
    """The GPU count torch.cuda sees, after NVML failed for `why` (torch is imported only here)."""
    import torch

    count = torch.cuda.device_count()
    print(f"warning: hardware=auto: NVML could not describe the GPUs ({why}); torch.cuda sees {count}, "
          "used without a device name or peak (MFU null); set hardware=<profile> to name them", file=sys.stderr)
    return GpuInfo(count)


def host_info() -> HostInfo:
    """This host's memory (the cgroup limit when lower) and usable cores, for `hardware=auto`:
    a profile's host numbers (a DGX's 2 TB) must not stand in for the machine the run is on."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit() and (mem is None or int(limit) < mem):
            mem = int(limit)
    except OSError:
        pass
    return HostInfo(round(mem / 2**30, 1) if mem else None, usable_cores())


def _first_visible(pynvml: Any, visible: str | None) -> Any:
    """NVML handle of CUDA device 0 (NVML's index 0 is the first *physical* device)."""
    kind, value = visible_entry(0, visible) or ("index", 0)
    if kind == "uuid":
        return pynvml.nvmlDeviceGetHandleByUUID(value)
    return pynvml.nvmlDeviceGetHandleByIndex(value)


def _compute_capability(pynvml: Any, handle: Any) -> tuple[int, int] | None:
    """(major, minor), or None when this driver's NVML cannot say (then no bf16 is assumed)."""
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    except Exception:
        return None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def visible_gpus() -> int:
    """Number of NVIDIA GPUs this process may use (NVML, honouring CUDA_VISIBLE_DEVICES)."""
    return gpu_info().count


def auto_overrides(overrides: list[str], one_device: bool = False) -> list[str]:
    """Overrides that turn `hardware=auto` into a concrete profile for this machine (NVML)."""
    return overrides_for(gpu_info(), overrides, host_info(), one_device)


def host_overrides(host: HostInfo | None, gpus: int) -> list[str]:
    """The measured host facts (and no NVLink for one GPU) in place of the profile's."""
    if host is None:
        return []
    out = [f"hardware.cpu_cores={host.cores}"]
    if host.memory_gb:
        out.append(f"hardware.host_memory_gb={host.memory_gb}")
    if gpus == 1:
        out.append("hardware.interconnect='none (one GPU)'")
    return out


def overrides_for(info: GpuInfo, overrides: list[str], host: HostInfo | None = None,
                  one_device: bool = False) -> list[str]:
    """`hardware=auto` for the GPUs `info` describes (a pure function of it).

    Every visible GPU: the shipped profile of a known device, else `gpu` with NVML's name and
    memory and the datasheet peaks of `GPU_PEAKS` (none found: MFU null). Never bf16 on a device
    without it (compute capability < 8.0, or unknown): fp16 mixed precision there. `one_device` (the
    chosen strategy's, e.g. `strategy=single`) gets one device. No GPU: `cpu`. `host` (measured) replaces the profile's host memory and
    cores. The concrete profile comes first so the user's own `hardware.*` overrides still win.
    """
    rest = [o for o in overrides if not o.startswith("hardware=")]
    devices = 1 if one_device and not user_set(overrides, "hardware.devices") else info.count
    host_facts = host_overrides(host, info.count)
    if not info.count:
        return ["hardware=cpu", *host_facts, *rest]
    profile = KNOWN_GPUS.get(info.name or "")
    if profile and bf16_capable(info.cc or (8, 0)):
        return [f"hardware={profile}", f"hardware.devices={devices}", *host_facts, *rest]
    found = [*host_facts, *([f"hardware.device_name='{info.name}'"] if info.name else [])]
    if info.memory_gb:
        found.append(f"hardware.device_memory_gb={info.memory_gb}")
    row = lookup(info.name, info.cc)
    if row:
        found += [f"hardware.peak_tflops.{k}={v}" for k, v in row.tflops().items()]
    if not bf16_capable(info.cc or (row.cc if row else None)):  # unknown: no bf16 either
        found += ["hardware.bf16_supported=false", "hardware.precision=16-mixed"]
    return ["hardware=gpu", f"hardware.devices={devices}", *found, *rest]


def user_set(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def check_machine(cfg: DictConfig, dry_run: bool = False) -> None:
    """Refuse a profile this machine cannot run (exit 2 before any process starts).

    `loom train` only: every node of a multi-node run starts the same command, so this node
    must have `hardware.devices` GPUs itself. `launcher: slurm` and `kubernetes` are submitted
    from a machine without GPUs: their own checks run instead (`hardware.schema.SUBMITTED`:
    sbatch here unless `--dry-run`; the TrainJob's image, claim, GPUs, credentials and kube
    context), and the nodes are the scheduler's to provide.
    """
    hw = cfg.hardware
    if hw.launcher in SUBMITTED:  # its own checks: sbatch here, or the TrainJob's inputs
        load(SUBMITTED[hw.launcher][1])(cfg, dry_run)
        return
    if hw.accelerator == "gpu":
        have = visible_gpus()
        if have == 0:
            raise ConfigError(
                f"Invalid config: hardware={hw.name} (hardware.accelerator=gpu) needs CUDA GPUs "
                "but this machine has none visible to NVML. Use hardware=cpu (or hardware=auto) "
                f"here; `loom plan hardware={hw.name}` still estimates the run without GPUs."
            )
        if hw.devices > have:
            raise ConfigError(
                f"Invalid config: hardware.devices={hw.devices} (hardware={hw.name}) but this "
                f"machine has {have} GPU(s). Set hardware.devices<={have}."
            )
    else:
        cores = usable_cores()
        limit = cpu_process_limit()
        if hw.devices > limit:
            raise ConfigError(
                f"Invalid config: hardware.devices={hw.devices} CPU processes on a machine with "
                f"{cores} core(s) would thrash; set hardware.devices<={limit} (hardware={hw.name})."
            )
    if hw.num_nodes > 1 and not cfg.run.id:
        raise ConfigError(
            f"Invalid config: run.id=null with hardware.num_nodes={hw.num_nodes}: every node starts "
            "its own launcher, and all of them must train in one run dir on shared storage. Set "
            "run.id=<name> (e.g. run.id=exp42) in the command you run on every node. Without it each "
            "node derives the id from its own resolved config, which matches only if the configs "
            "are byte-identical: one differing override (a typo, another run.root) splits the run "
            "into separate run dirs whose ranks wait for each other."
        )


def check_sbatch(cfg: DictConfig, dry_run: bool) -> None:
    """`loom train` with launcher=slurm: sbatch must be here unless only the script is wanted."""
    if dry_run or shutil.which("sbatch"):
        return
    raise ConfigError(
        f"Invalid config: hardware.launcher=slurm (hardware={cfg.hardware.name}) submits the run "
        "with `sbatch`, which is not on PATH here. Run `loom train` on a SLURM login node, or add "
        "--dry-run (`loom train --dry-run hardware=slurm ...`) to only write <run>/slurm/job.sbatch "
        "and print the sbatch command that submits it.")


def cpu_process_limit() -> int:
    """The most CPU processes `loom train` starts on this machine (more would thrash its cores);
    the plan's hints suggest no more."""
    return 4 * usable_cores()
