"""A hardware profile's own consistency, for every verb (`loom plan hardware=h100x8` works on a
laptop): counts, backend, precision, rendezvous and the SLURM request. Whether *this* machine
can run the profile is `loom.hardware.machine.check_machine`, for `loom train` only."""

from __future__ import annotations

import re

from omegaconf import DictConfig

from loom.errors import ConfigError, require
from loom.hardware.schema import BACKENDS, LAUNCHERS, PEAK_KEYS, PRECISIONS
from loom.layout import ParallelLayout
from loom.schema import nothing_to_fill as normalize  # noqa: F401  (`hardware=auto` is resolved at compose)

# sbatch options Loom sets from the profile: hardware.slurm.extra_args may not set them again.
MANAGED = {
    "--nodes": "hardware.num_nodes", "-N": "hardware.num_nodes",
    "--ntasks-per-node": "one torchrun per node", "--ntasks": "one torchrun per node",
    "-n": "one torchrun per node",
    "--gpus-per-node": "hardware.devices", "--gpus": "hardware.devices", "-G": "hardware.devices",
    "--gres": "hardware.devices", "--gpus-per-task": "hardware.devices",
    "--time": "hardware.slurm.time_limit", "-t": "hardware.slurm.time_limit",
    "--partition": "hardware.slurm.partition", "-p": "hardware.slurm.partition",
    "--account": "hardware.slurm.account", "-A": "hardware.slurm.account",
    "--qos": "hardware.slurm.qos", "-q": "hardware.slurm.qos",
    "--constraint": "hardware.slurm.constraint", "-C": "hardware.slurm.constraint",
    "--cpus-per-task": "hardware.slurm.cpus_per_task", "-c": "hardware.slurm.cpus_per_task",
    "--mem": "hardware.slurm.mem_gb",
    "--signal": "hardware.slurm.signal_before_s",
    "--requeue": "Loom requeues at the time limit", "--no-requeue": "Loom requeues at the time limit",
    "--output": "<run>/slurm/slurm-%j.out", "-o": "<run>/slurm/slurm-%j.out",
    "--error": "<run>/slurm/slurm-%j.out", "-e": "<run>/slurm/slurm-%j.out",
    "--open-mode": "append (requeued attempts share the log)",
    "--job-name": "loom-<run id>", "-J": "loom-<run id>",
}


def check(cfg: DictConfig, layout: ParallelLayout) -> None:
    hw = cfg.hardware
    for key in ("devices", "num_nodes"):
        require(hw[key] >= 1, f"hardware.{key}", hw[key], "must be a positive integer (>= 1)")
    for key in ("max_restarts", "dataloader_workers"):
        require(hw[key] >= 0, f"hardware.{key}", hw[key], "must be >= 0 (0 disables it)")
    require(hw.accelerator in ("cpu", "gpu"), "hardware.accelerator", hw.accelerator, "valid choices: cpu, gpu")
    require(hw.precision in PRECISIONS, "hardware.precision", hw.precision,
            f"valid choices: {', '.join(PRECISIONS)}")
    _check_devices(hw)
    _check_rendezvous(hw)
    if hw.launcher == "slurm":
        require(hw.slurm is not None, "hardware.slurm", hw.slurm,
                "hardware.launcher=slurm needs a hardware.slurm block (partition, account, "
                "time_limit, ...); start from conf/hardware/slurm.yaml")
    if hw.slurm is not None:
        _check_slurm(hw)


def _check_devices(hw: DictConfig) -> None:
    gpu = hw.accelerator == "gpu"
    require(hw.backend in BACKENDS, "hardware.backend", hw.backend,
            f"valid choices: {', '.join(BACKENDS)} (nccl on GPUs, gloo on CPUs)")
    require(gpu or hw.backend != "nccl", "hardware.backend", hw.backend,
            f"nccl needs GPUs but hardware.accelerator={hw.accelerator}; set hardware.backend=gloo")
    require(hw.launcher in LAUNCHERS, "hardware.launcher", hw.launcher, f"valid choices: {', '.join(LAUNCHERS)}")
    if gpu and hw.precision.startswith("bf16"):
        require(hw.bf16_supported, "hardware.precision", hw.precision,
                f"hardware={hw.name} ({hw.device_name}) has no bf16 support "
                "(hardware.bf16_supported=false; bf16 needs Ampere or later); "
                "set hardware.precision=16-mixed or hardware.precision=32-true")
    for key, val in (hw.peak_tflops or {}).items():
        require(key in PEAK_KEYS, f"hardware.peak_tflops.{key}", val,
                f"unknown precision key; valid keys: {', '.join(PEAK_KEYS)}")
        require(val is None or val > 0, f"hardware.peak_tflops.{key}", val,
                "must be > 0 (TFLOP/s per device; leave the key out when unknown)")
    for key in ("device_memory_gb", "host_memory_gb"):
        require(hw[key] is None or hw[key] > 0, f"hardware.{key}", hw[key], "must be > 0 (GB)")
    require(hw.cpu_cores >= 1, "hardware.cpu_cores", hw.cpu_cores, "must be >= 1")
    for key in ("timeout_init_s", "timeout_train_s"):
        require(hw[key] > 0, f"hardware.{key}", hw[key],
                "must be > 0 (seconds a collective may wait before the process group aborts)")
    hang = hw.get("hang_timeout_s")
    require(hang is None or 0 <= hang < hw.timeout_train_s, "hardware.hang_timeout_s", hang,
            f"must be below hardware.timeout_train_s={hw.timeout_train_s:g} (the collective timeout, which would "
            "end the run first, with no report), or 0 for no watchdog, or null for 80% of it")


def _check_rendezvous(hw: DictConfig) -> None:
    if hw.rdzv_endpoint is not None:
        host, _, port = str(hw.rdzv_endpoint).rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "hardware.rdzv_endpoint",
                hw.rdzv_endpoint, "must be host:port, e.g. hardware.rdzv_endpoint=node0.cluster:29500")
    if hw.num_nodes > 1 and hw.launcher == "torchrun":
        require(hw.rdzv_endpoint is not None, "hardware.rdzv_endpoint", hw.rdzv_endpoint,
                f"hardware.num_nodes={hw.num_nodes} needs a rendezvous endpoint that every node "
                "reaches; set hardware.rdzv_endpoint=<host of node 0>:29500 and run the same "
                "`loom train` command on every node")
    if hw.min_nodes is not None:
        require(1 <= hw.min_nodes <= hw.num_nodes, "hardware.min_nodes", hw.min_nodes,
                f"must be between 1 and hardware.num_nodes={hw.num_nodes} (torchrun --nnodes=min:max), "
                "or null for a fixed number of nodes")
    for key in ("rdzv_keep_alive_s", "rdzv_last_call_s"):
        require(hw[key] >= 1, f"hardware.{key}", hw[key],
                "must be a whole number of seconds >= 1 (torchrun's c10d rendezvous timing)")


def elastic(hw: DictConfig) -> bool:
    """Whether torchrun may form fewer nodes than hardware.num_nodes (hardware.min_nodes): a
    lost node then shrinks the world instead of ending the run."""
    low = hw.get("min_nodes")
    return low is not None and low < hw.num_nodes


def time_limit_s(text: str) -> int | None:
    """sbatch --time in seconds (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None if malformed."""
    days, _, rest = text.rpartition("-")
    parts = rest.split(":")
    if (days and not days.isdigit()) or not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [int(p) for p in parts]
    if days:
        h, m, s = (nums + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


def _check_slurm(hw: DictConfig) -> None:
    """One torchrun per node: the allocation is num_nodes x 1 task, each task holding
    `hardware.devices` GPUs. Options Loom sets itself may not be set again in extra_args."""
    sl = hw.slurm
    limit = time_limit_s(str(sl.time_limit))
    require(limit is not None, "hardware.slurm.time_limit", sl.time_limit,
            "must be [D-]HH:MM:SS or minutes, as sbatch --time takes it, e.g. 04:00:00")
    if sl.gpus_per_node is not None:
        require(sl.gpus_per_node == hw.devices, "hardware.slurm.gpus_per_node", sl.gpus_per_node,
                f"must equal hardware.devices={hw.devices} (one process per GPU), or be null")
    for key in ("cpus_per_task", "mem_gb"):
        require(sl[key] is None or sl[key] > 0, f"hardware.slurm.{key}", sl[key], "must be > 0 or null")
    for arg in sl.extra_args or []:
        text = str(arg).strip()
        name = re.split(r"[=\s]", text, maxsplit=1)[0]
        if not name.startswith("-"):
            raise ConfigError(
                f"Invalid config: hardware.slurm.extra_args has {text!r}: each item is one sbatch "
                "option, e.g. '--exclusive' or '--mail-type=END'.")
        if name in MANAGED:
            raise ConfigError(
                f"Invalid config: hardware.slurm.extra_args has {text!r}, but Loom sets {name} itself "
                f"from {MANAGED[name]}; set that instead and drop {name} from extra_args.")
    if not 0 < sl.signal_before_s < limit:
        raise ConfigError(
            f"Invalid config: hardware.slurm.signal_before_s={sl.signal_before_s} must be > 0 and below "
            f"hardware.slurm.time_limit={sl.time_limit} ({limit} s): SIGUSR1 comes that long before "
            "the limit, to checkpoint and requeue.")
    if not 0 < sl.rdzv_port < 64536:
        raise ConfigError(f"Invalid config: hardware.slurm.rdzv_port={sl.rdzv_port} must be a TCP port "
                          "below 64536 (the job id % 1000 is added to it).")
    if sl.cpus_per_task is not None and sl.cpus_per_task < hw.devices:
        raise ConfigError(
            f"Invalid config: hardware.slurm.cpus_per_task={sl.cpus_per_task} but each node's single "
            f"task (one torchrun) runs hardware.devices={hw.devices} rank(s): set it >= {hw.devices}, "
            "or null for devices x (1 + dataloader_workers).")
