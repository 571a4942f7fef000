"""GPU ranks' environment (NCCL error handling, flight recorder, allocator), the collective
timeouts, and the garbage-collection schedule: pure functions and one in-process gloo group."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from loom.errors import ConfigError
from loom.launch import gpu_env, worker_env
from loom.launch.slurm import render
from loom.pipeline import resolve

GPU = ["hardware=h100x8", "hardware.devices=2", "run.id=r1"]


def test_gpu_ranks_get_nccl_and_allocator_defaults(tmp_path, monkeypatch):
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "PYTORCH_CUDA_ALLOC_CONF",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(key, raising=False)
    env = worker_env(resolve(GPU), tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "nccl_trace_rank_")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_users_own_env_wins_and_cpu_runs_get_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env = worker_env(resolve(GPU), tmp_path)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert gpu_env(resolve(["hardware=cpu"]), tmp_path) == {}


def test_slurm_script_exports_the_gpu_env_with_the_users_value_first(tmp_path):
    cfg = resolve(["hardware=slurm", "run.id=r1"])
    assert cfg.hardware.accelerator == "gpu"
    script = render(cfg, tmp_path)
    assert 'export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"' in script
    trace = tmp_path.resolve() / "logs" / "nccl_trace_rank_"
    assert f'TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${{TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-{trace}}}"' in script
    p = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    cpu = ["hardware=slurm", "hardware.accelerator=cpu", "hardware.backend=gloo", "hardware.precision=32-true"]
    assert "TORCH_NCCL" not in render(resolve([*cpu, "run.id=r1"]), tmp_path)


@pytest.mark.parametrize("key", ["timeout_init_s", "timeout_train_s"])
def test_timeouts_must_be_positive(key):
    cfg = resolve([])
    assert cfg.hardware.timeout_init_s > cfg.hardware.timeout_train_s > 0
    with pytest.raises(ConfigError, match=f"hardware.{key}"):
        resolve([f"hardware.{key}=0"])


def test_init_binds_nccl_to_the_local_gpu_and_uses_the_init_timeout():
    import torch

    from loom.worker.distributed import init_options

    opts = init_options("nccl", 3, 900)
    assert opts["device_id"] == torch.device("cuda", 3) and opts["timeout"].total_seconds() == 900
    assert "device_id" not in init_options("gloo", 3, 900)


SHORTEN = """
import datetime, torch, torch.distributed as dist
from loom.worker.distributed import init_options, set_train_timeout
assert set_train_timeout(5) == 0
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **init_options("gloo", 0, 600))
dist.new_group([0])
assert set_train_timeout(120) == 2
for pg in dist.distributed_c10d._world.pg_map:
    assert pg._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=120)
print("ok")
"""


def test_train_timeout_shortens_every_group():
    # A subprocess: the default process group is per process, and other tests may hold one.
    p = subprocess.run([sys.executable, "-c", SHORTEN], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


class _Trainer:
    """The two attributes the GC callback reads (a real Trainer is irrelevant to the schedule)."""

    def __init__(self) -> None:
        self.global_step = 0


def test_gc_is_disabled_in_training_collected_every_n_steps_and_restored():
    from loom.worker.gc_control import GarbageCollection

    assert gc.isenabled()
    cb, tr = GarbageCollection(3), _Trainer()
    cb.on_train_start(tr, None)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for step in (1, 1, 2, 3, 3, 3, 4, 5, 6, 7):  # repeated steps: gradient accumulation
            tr.global_step = step
            cb.on_train_batch_end(tr, None, None, None, 0)
        assert cb.collections == 2  # steps 3 and 6, once each
    finally:
        cb.on_train_end(tr, None)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_every_0_leaves_pythons_collector_alone():
    from loom.worker.gc_control import GarbageCollection

    cb = GarbageCollection(0)
    cb.on_train_start(_Trainer(), None)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert resolve([]).trainer.gc_every_n_steps == 50


def test_an_in_process_rank_leaves_the_launchers_environment_as_it_was(monkeypatch):
    """A one-process run trains inside the launcher (loom.launch._launch), and the rank, Lightning
    and the libraries it loads set environment variables there: OMP_NUM_THREADS to every core
    (lightning_fabric's _set_num_threads_if_needed, Loom's worker). Kept, the launcher's next run
    (a sweep's next trial) would hand each of its ranks that many threads. After the rank: as before."""
    import torch
    from lightning_fabric.utilities.distributed import _set_num_threads_if_needed

    from loom.launch import rank_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, before = torch.get_num_threads(), dict(os.environ)
    try:
        with rank_environment({"LOOM_LAUNCH_TIME": "1"}):
            _set_num_threads_if_needed(num_processes=1)
            assert os.environ["OMP_NUM_THREADS"] and os.environ["LOOM_LAUNCH_TIME"] == "1"
        assert dict(os.environ) == before
    finally:
        torch.set_num_threads(threads)
