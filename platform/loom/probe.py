"""`loom probe`: measure this machine and write a hardware profile that `hardware=` selects.

Two numbers, each the best of a few timed repeats after a warm-up:
- matmul TFLOP/s in the profile's default precision (fp32 on CPU, bf16 on GPU):
  2*n^3 FLOPs per n x n @ n x n product;
- all-reduce bus bandwidth over the profile's backend (gloo on CPU with 2 local processes,
  NCCL across every GPU): busbw = bytes * 2(n-1)/n / time, the convention of nccl-tests,
  so the number compares across world sizes and with the link's rated bandwidth.

The profile keeps the datasheet numbers of a known device (`peak_tflops`) next to the
measured ones (`measured`). A CPU has no datasheet peak here, so `peak_tflops.fp32` is set to
the measured matmul rate: MFU on that machine is then relative to what a large fp32 matmul
reaches, and the file says so.

torch is imported inside the functions only: the CLI module stays torch-free.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from loom.compose import conf_dir
from loom.errors import ConfigError
from loom.hardware.machine import KNOWN_GPUS, usable_cores
from loom.hardware.peaks import lookup
from loom.hardware.schema import HardwareConfig
from loom.schema import typed

CPU_SIZE, GPU_SIZE = 1024, 8192


def matmul_tflops(device: str, dtype_name: str, n: int, repeats: int) -> float:
    """Best TFLOP/s of `repeats` timed n x n matmuls (each timing at least ~0.1 s)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    # Warm up, and size the inner loop so one timing lasts ~0.1 s.
    sync()
    t0 = time.perf_counter()
    a @ b
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(50, int(0.1 / once)))
    best = 0.0
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 * inner / dt / 1e12)
    return best


def _allreduce_worker(rank: int, world: int, port: int, backend: str, numel: int, iters: int,
                      result: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // world))
        device = "cpu"
    else:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.ones(numel, dtype=torch.float32, device=device)
        best = float("inf")
        for i in range(iters + 2):  # the first two are warm-up
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device != "cpu":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if i >= 2:
                best = min(best, dt)
        t = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's best is the collective's time
        if rank == 0:
            Path(result).write_text(repr(float(t.item())))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allreduce_busbw(world: int, backend: str, nbytes: int, iters: int = 5) -> float:
    """Bus bandwidth in GB/s of an fp32 all-reduce of `nbytes` across `world` local processes."""
    import torch.multiprocessing as mp

    numel = max(1, nbytes // 4)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "t")
        mp.start_processes(_allreduce_worker, args=(world, _free_port(), backend, numel, iters, result),
                           nprocs=world, join=True, start_method="spawn")
        seconds = float(Path(result).read_text())
    return numel * 4 * 2 * (world - 1) / world / seconds / 1e9


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _base_profile(name: str) -> dict[str, Any]:
    """A shipped profile as a plain dict (its Hydra `defaults` resolved by hand: one level)."""
    node = OmegaConf.to_container(OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml"))
    parents = node.pop("defaults", []) or []
    merged: dict[str, Any] = {}
    for parent in parents:
        if isinstance(parent, str) and parent != "_self_":
            merged.update(_base_profile(parent))
    merged.update(node)
    return merged


def _writable(path: Path, out: str | None) -> None:
    """Refuse before measuring when the profile cannot be written (tried, not guessed from mode
    bits): an installed Loom's config folder sits in site-packages, which an image may mount
    read-only."""
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        where = "--out" if out else "the default: Loom's config folder"
        raise ConfigError(f"Invalid usage: loom probe cannot write {path} ({where}; {e.strerror}): pass "
                          "--out FILE.yaml in a folder you can write, then copy the profile into the "
                          "hardware/ folder of the config directory LOOM_CONF_DIR names.") from None


def default_out() -> Path:
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname().split(".")[0]) or "host"
    return conf_dir() / "hardware" / f"probe_{host}.yaml"


def _device_profile(processes: int | None) -> tuple[dict[str, Any], str, str, str, int, str | None]:
    """(profile to fill, matmul dtype, device, backend, all-reduce ranks, where its peaks come from)."""
    import torch

    if not torch.cuda.is_available():
        profile = _base_profile("cpu")
        profile.update(device_name=_cpu_name())
        return profile, "float32", "cpu", "gloo", processes or 2, None
    count = torch.cuda.device_count()
    dev_name = torch.cuda.get_device_name(0)
    known = KNOWN_GPUS.get(dev_name)
    profile = _base_profile(known or "gpu")
    profile.update(devices=count, device_name=dev_name,
                   device_memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))
    major, minor = torch.cuda.get_device_capability(0)
    row = None if known else lookup(dev_name, (major, minor))
    source = f"conf/hardware/{known}.yaml" if known else None
    if row:  # no shipped profile, but the datasheet table knows it: MFU gets a real peak
        profile["peak_tflops"] = row.tflops()
        source = f"hardware.peaks.GPU_PEAKS ({dev_name}, compute capability {major}.{minor})"
    profile["bf16_supported"] = major >= 8
    if major < 8:
        profile["precision"] = "16-mixed"
    return profile, ("bfloat16" if major >= 8 else "float16"), "cuda", "nccl", processes or count, source


def measure(size: int | None, repeats: int, allreduce_mb: float,
            processes: int | None) -> dict[str, Any]:
    """Run the measurements; returns the profile dict (not yet written)."""
    import psutil
    import torch

    profile, dtype, device, backend, world, peak_source = _device_profile(processes)
    gpu = device == "cuda"
    n = size or (GPU_SIZE if gpu else CPU_SIZE)
    threads = None
    if not gpu:
        # A CPU "device" is one rank, which gets cores / devices threads (as the worker sets):
        # measure at that width so the peak is per device, like a GPU's.
        threads = max(1, usable_cores() // int(profile["devices"]))
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tflops = matmul_tflops(device, dtype, n, repeats)
    t_matmul = time.perf_counter() - t0
    nbytes = int(allreduce_mb * 1e6)
    busbw = None
    t0 = time.perf_counter()
    if world >= 2 and (not gpu or world <= torch.cuda.device_count()):
        busbw = allreduce_busbw(world, backend, nbytes)
    t_comm = time.perf_counter() - t0
    measured = busbw is not None
    profile.update(
        host_memory_gb=round(psutil.virtual_memory().total / 1e9, 1),
        cpu_cores=os.cpu_count() or 1,
        backend=backend,
        measured={
            "matmul_tflops": round(tflops, 4), "matmul_dtype": dtype, "matmul_size": n, "matmul_threads": threads,
            "allreduce_busbw_gbps": round(busbw, 4) if measured else None,
            "allreduce_backend": backend if measured else None,
            "allreduce_world_size": world if measured else None,
            "allreduce_bytes": (max(1, nbytes // 4) * 4) if measured else None,
            "host": socket.gethostname(),
            "torch_version": str(torch.__version__),
            "probed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        },
    )
    if not gpu:
        profile["peak_tflops"] = {**(profile.get("peak_tflops") or {}), "fp32": round(tflops, 4)}
    profile.pop("resolved_from", None)
    profile["_timings"] = {"matmul_s": t_matmul, "allreduce_s": t_comm, "peak_source": peak_source}
    return profile


def render_yaml(profile: dict[str, Any], name: str) -> str:
    body = {k: v for k, v in profile.items() if not k.startswith("_")}
    body["name"] = name
    body = {"name": name, **{k: v for k, v in body.items() if k != "name"}}
    text = OmegaConf.to_yaml(OmegaConf.create(body))
    m = body["measured"]
    peak_source = profile.get("_timings", {}).get("peak_source")
    cpu = body["accelerator"] == "cpu"
    head = [
        f"# Written by `loom probe` on {m['host']} at {m['probed_at']} (torch {m['torch_version']}).",
        f"# Select it with hardware={name}. `measured` holds this machine's numbers: matmul_tflops is",
        f"# the best of timed {m['matmul_size']}x{m['matmul_size']} {m['matmul_dtype']} matmuls on one device;",
        "# allreduce_busbw_gbps the all-reduce bus bandwidth in GB/s (bytes * 2(n-1)/n / time,",
        "# as nccl-tests reports it).",
    ]
    if cpu:
        head += ["# peak_tflops.fp32 is the *measured* matmul rate of one rank (no CPU datasheet peak",
                 f"# is known here) at {m['matmul_threads']} thread(s) = cores / devices: MFU on this machine is",
                 "# relative to a large fp32 matmul, and is valid for this hardware.devices only."]
    elif peak_source:
        head += [f"# peak_tflops: datasheet numbers of {peak_source} (dense), not measured."]
    else:
        head += ["# peak_tflops: unknown for this device (MFU stays null). Set it from the datasheet;",
                 "# the measured matmul rate is a lower bound, not a peak."]
    return "\n".join(head) + "\n" + text


def probe(out: str | None = None, size: int | None = None, repeats: int = 5,
          allreduce_mb: float = 32.0, processes: int | None = None) -> int:
    if repeats < 1 or (size is not None and size < 16) or allreduce_mb <= 0 or (processes is not None and processes < 1):
        raise ConfigError("Invalid usage: loom probe needs --repeats >= 1, --size >= 16, "
                          "--allreduce-mb > 0 and --processes >= 1.")
    path = Path(out) if out else default_out()
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"Invalid usage: loom probe --out {out}: the profile must be a .yaml file.")
    name = re.sub(r"[^A-Za-z0-9_]", "_", path.stem)
    _writable(path, out)
    t0 = time.perf_counter()
    profile = measure(size, repeats, allreduce_mb, processes)
    text = render_yaml(profile, name)
    # The file must be a profile Loom accepts: type it with the schema before writing.
    typed("hardware", HardwareConfig, OmegaConf.create(text))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    m = profile["measured"]
    t = profile["_timings"]
    bw = (f"{m['allreduce_busbw_gbps']:.3f} GB/s ({m['allreduce_backend']}, {m['allreduce_world_size']} "
          f"processes, {m['allreduce_bytes'] / 1e6:.0f} MB, {t['allreduce_s']:.1f} s)"
          if m["allreduce_busbw_gbps"] is not None else "not measured (one device)")
    print(f"matmul    {m['matmul_tflops']:.4f} TFLOP/s ({m['matmul_dtype']}, n={m['matmul_size']}, "
          f"best of {repeats}, {t['matmul_s']:.1f} s)")
    print(f"allreduce {bw}")
    where = path.resolve()
    selectable = where.parent == (conf_dir() / "hardware").resolve()
    print(f"profile   {where} ({time.perf_counter() - t0:.1f} s)")
    print(f"use it:   loom plan hardware={name}" if selectable else
          f"use it:   copy it to {conf_dir() / 'hardware'}/ and select hardware={name}")
    sys.stdout.flush()
    return 0
