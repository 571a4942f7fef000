"""The schema of a hardware profile (every option of conf/hardware/ shares it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SlurmConfig:
    """Where a `launcher: slurm` job runs (the sbatch/srun options Loom will pass)."""

    partition: str | None = None      # null: the cluster's default partition
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"      # [D-]HH:MM:SS, as sbatch --time takes it
    gpus_per_node: int | None = None  # null: hardware.devices
    cpus_per_task: int | None = None
    mem_gb: float | None = None       # per node; null: the partition's default
    constraint: str | None = None
    extra_args: list[str] = field(default_factory=list)  # more `#SBATCH` options, e.g. ["--exclusive"]
    signal_before_s: int = 90         # SIGUSR1 this long before the time limit: checkpoint + requeue
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load ...)
    rdzv_port: int = 29500            # c10d rendezvous port on the first node (+ job id % 1000)


@dataclass
class MeasuredConfig:
    """What `loom probe` measured on a machine (kept next to the datasheet numbers)."""

    matmul_tflops: float | None = None
    matmul_dtype: str | None = None
    matmul_size: int | None = None
    matmul_threads: int | None = None     # CPU: the threads one rank gets (cores / devices)
    allreduce_busbw_gbps: float | None = None  # GB/s (bytes), nccl-tests' bus bandwidth
    allreduce_backend: str | None = None
    allreduce_world_size: int | None = None
    allreduce_bytes: int | None = None
    host: str | None = None
    torch_version: str | None = None
    probed_at: str | None = None


@dataclass
class HardwareConfig:
    name: str = "cpu"
    accelerator: str = "cpu"          # cpu | gpu
    devices: int = 2                  # processes (cpu) or GPUs per node
    num_nodes: int = 1
    min_nodes: int | None = None      # elastic: torchrun --nnodes=min_nodes:num_nodes (null: num_nodes)
    max_restarts: int = 0
    precision: str = "32-true"
    backend: str = "gloo"             # gloo | nccl (nccl needs accelerator=gpu)
    launcher: str = "torchrun"        # torchrun | slurm | kubernetes (the top-level `kubernetes` block)
    device_name: str = "cpu"
    device_memory_gb: float | None = None
    bf16_supported: bool = True       # false for pre-Ampere GPUs (V100, T4)
    # Datasheet dense peak per precision (bf16, fp16, tf32, fp32; fp8 and mxfp8 for float8 training),
    # TFLOP/s per device.
    # null or missing key: MFU is null.
    peak_tflops: dict[str, float | None] = field(default_factory=dict)
    # fp32 matmuls and convolutions in TF32 on GPUs that have it (Ampere and later; ~1e-3
    # relative error, the TF32 peak: 494.7 against fp32's 66.9 TFLOP/s on an H100), as torchtitan
    # does; the plan's peak for precision=32-true follows. No effect on the CPU.
    tf32: bool = True
    host_memory_gb: float = 16.0
    cpu_cores: int = 2
    interconnect: str = "loopback"
    dataloader_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2          # batches each dataloader worker loads ahead (workers > 0)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (required for num_nodes > 1)
    # Elastic runs (min_nodes < num_nodes), torchrun's c10d rendezvous timings: agents heartbeat
    # every rdzv_keep_alive_s and a node silent for 3 of them counts as lost; once min_nodes have
    # joined a round, it waits rdzv_last_call_s more for late nodes. torch's defaults: 5 s, 30 s.
    rdzv_keep_alive_s: int = 5
    rdzv_last_call_s: int = 30
    # Collective timeouts (s): generous while ranks build, load and compile; shorter once the first
    # step ran, so a hung rank fails the job (and NCCL's flight recorder dumps) in minutes.
    timeout_init_s: float = 600
    timeout_train_s: float = 300
    # No step progress for this long (after the first step): every rank dumps its stacks to
    # logs/hang-rank-N.txt and the run fails (or restarts) with a paragraph saying where each rank
    # stood (loom.worker.hang). Below timeout_train_s; null: 80% of it; 0: no watchdog.
    hang_timeout_s: float | None = None
    slurm: SlurmConfig | None = None
    measured: MeasuredConfig | None = None
    resolved_from: str | None = None


# Every profile has the same shape: one schema for all options.
SCHEMAS: dict[str, type] = {"*": HardwareConfig}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
PEAK_KEYS = ("bf16", "fp16", "tf32", "fp32", "fp8", "mxfp8")  # fp8 / mxfp8: float8 training (loom.float8)
BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("torchrun", "slurm", "kubernetes")
# Launchers that submit the frozen run as a job elsewhere (no ranks start on this machine), and
# their "module:function" submit(cfg, run_dir, dry_run) -> exit code, check(cfg, dry_run).
SUBMITTED = {"slurm": ("loom.launch.slurm:submit", "loom.hardware.machine:check_sbatch"),
             "kubernetes": ("loom.launch.kube_follow:submit", "loom.launch.kubernetes:check")}
