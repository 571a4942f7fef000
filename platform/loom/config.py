"""Compose the run config with Hydra and validate it against typed schemas.

This module must stay free of torch/Lightning imports: a bad config is refused before the
heavy imports load (the CLI's first second). Everything invalid becomes a `ConfigError`
whose message is one paragraph naming the full key, the bad value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

GROUPS = ("hardware", "strategy", "dataset", "model", "optim", "tracking")


class ConfigError(Exception):
    """An invalid config or usage: the CLI prints the message and exits 2."""


def conf_dir() -> Path:
    """The primary config directory: `$LOOM_CONF_DIR`, else `conf/` of this checkout."""
    env = os.environ.get("LOOM_CONF_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "conf"


# ----------------------------------------------------------------------------- schemas


@dataclass
class RunConfig:
    id: str | None = None
    root: str = "runs"
    sweep_dir: str | None = None  # set by a sweep: its trials' run dirs live there


@dataclass
class SweepConfig:
    params: dict[str, str] = field(default_factory=dict)  # key -> Hydra sweep syntax, e.g. "ddp,zero2"
    sampler: str = "grid"         # grid | optuna
    n_trials: int = 8             # optuna
    objective: str = "final_loss"  # a summary.json metric (optuna)
    direction: str = "minimize"
    seed: int = 0


@dataclass
class TrainerConfig:
    max_steps: int = 200
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    val_every_n_steps: int = 0
    limit_val_batches: int = 8


@dataclass
class CheckpointConfig:
    every_n_steps: int = 100
    keep_last: int = 2


@dataclass
class SecurityConfig:
    allow_targets: list[str] = field(default_factory=list)


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
    launcher: str = "torchrun"        # torchrun | slurm
    device_name: str = "cpu"
    device_memory_gb: float | None = None
    bf16_supported: bool = True       # false for pre-Ampere GPUs (V100, T4)
    # Datasheet dense peak per precision (bf16, fp16, tf32, fp32), TFLOP/s per device.
    # null or missing key: MFU is null.
    peak_tflops: dict[str, float | None] = field(default_factory=dict)
    host_memory_gb: float = 16.0
    cpu_cores: int = 2
    interconnect: str = "loopback"
    dataloader_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2          # batches each dataloader worker loads ahead (workers > 0)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (required for num_nodes > 1)
    slurm: SlurmConfig | None = None
    measured: MeasuredConfig | None = None
    resolved_from: str | None = None


@dataclass
class SingleStrategyConfig:
    name: str = "single"


@dataclass
class DDPStrategyConfig:
    name: str = "ddp"
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    comm_hook: str | None = None
    powersgd_rank: int = 1


@dataclass
class FSDPStrategyConfig:
    """FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy."""

    name: str = "fsdp"
    reshard_after_forward: bool = True
    hybrid_shard: bool = True
    shard_units: list[str] | None = None


@dataclass
class FSDPTPStrategyConfig:
    """FSDP2 across the data-parallel mesh dim x tensor parallel across the other."""

    name: str = "fsdp_tp"
    tensor_parallel: int = 2
    reshard_after_forward: bool = True
    shard_units: list[str] | None = None


@dataclass
class DeepSpeedStrategyConfig:
    """DeepSpeed ZeRO stage 1/2/3 (`zero3_offload`: stage 3 + optimizer on the host)."""

    name: str = "zero2"
    offload_optimizer: bool = False
    offload_params: bool = False
    deepspeed_config: str | None = None


@dataclass
class TinycodeDatasetConfig:
    name: str = "tinycode"
    batch_size: int = 16
    seq_len: int = 128
    max_bytes: int = 16_000_000
    val_every: int = 20
    tokenizer: str | None = None      # null: byte-level (vocab 256); else a local HF tokenizer
    cache_dir: str | None = None


@dataclass
class TextFilesDatasetConfig:
    name: str = "text_files"
    batch_size: int = 16
    seq_len: int = 128
    paths: list[str] = field(default_factory=list)  # files or glob patterns (`**` recursive)
    max_bytes: int | None = None      # cap on the corpus size (first files in sorted order)
    val_every: int = 20               # every Nth file goes to validation (0: none)
    tokenizer: str | None = None
    cache_dir: str | None = None


@dataclass
class HFDatasetConfig:
    name: str = "hf"
    batch_size: int = 16
    seq_len: int = 128
    hub: str | None = None            # a hub dataset id (offline: from the local HF cache)
    config: str | None = None         # the hub dataset's config name
    split: str = "train"
    path: str | None = None           # a save_to_disk dir or local json/csv/txt/parquet files
    text_column: str = "text"
    online: bool = False              # false: HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1
    val_every: int = 20               # every Nth document goes to validation (0: none)
    max_docs: int | None = None
    tokenizer: str | None = None
    cache_dir: str | None = None


@dataclass
class DigitsDatasetConfig:
    name: str = "digits"
    batch_size: int = 32
    val_every: int = 5                # every Nth sample goes to validation (0: none)


@dataclass
class SyntheticDatasetConfig:
    name: str = "synthetic"
    batch_size: int = 16
    kind: str = "tokens"              # tokens | tensors
    seq_len: int = 128                # tokens
    vocab_size: int = 256             # tokens
    shape: list[int] = field(default_factory=lambda: [64])  # tensors: one sample's shape
    num_classes: int = 10             # tensors
    num_samples: int = 8192


@dataclass
class GPTModelConfig:
    name: str = "gpt_tiny"
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    vocab_size: int = 256
    block_size: int = 256
    dropout: float = 0.0


@dataclass
class MLPModelConfig:
    name: str = "mlp"
    in_features: int | None = None    # null: from the dataset (digits: 64)
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    num_classes: int | None = None    # null: from the dataset (digits: 10)
    dropout: float = 0.0


@dataclass
class HFCausalLMModelConfig:
    name: str = "hf_causal_lm"
    config: str | None = None         # a local dir with config.json, or a name in the HF cache
    overrides: dict[str, Any] = field(default_factory=dict)  # set on the AutoConfig, e.g. {n_layer: 2}
    vocab_size: int | None = None     # null: the config's
    random_init: bool = False         # false: load the weights when they are local, else random


@dataclass
class CustomModelConfig:
    name: str = "custom"
    # `_target_` (+ its keyword arguments): a LightningModule, or an nn.Module trained with `loss`
    module: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1


@dataclass
class TrackingConfig:
    name: str = "offline"
    wandb: bool = True
    csv: bool = True
    mode: str = "offline"             # wandb mode: offline | online (needs an API key) | disabled
    project: str = "loom"
    entity: str | None = None


# Which schema types each group option. A group option's yaml declares `name:`; options of
# one group that share a shape share a schema.
SCHEMAS: dict[str, dict[str, type]] = {
    "hardware": {"*": HardwareConfig},
    "strategy": {"single": SingleStrategyConfig, "ddp": DDPStrategyConfig,
                 "fsdp": FSDPStrategyConfig, "fsdp_tp": FSDPTPStrategyConfig,
                 **{z: DeepSpeedStrategyConfig for z in ("zero1", "zero2", "zero3", "zero3_offload")}},
    "dataset": {"tinycode": TinycodeDatasetConfig, "text_files": TextFilesDatasetConfig, "hf": HFDatasetConfig,
                "digits": DigitsDatasetConfig, "synthetic": SyntheticDatasetConfig},
    "model": {**{name: GPTModelConfig for name in ("gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b")},
              "mlp": MLPModelConfig, "hf_causal_lm": HFCausalLMModelConfig, "custom": CustomModelConfig},
    "optim": {"adamw": AdamWConfig},
    "tracking": {"*": TrackingConfig},
}
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "security": SecurityConfig,
    "sweep": SweepConfig,
}
TOP_LEVEL = {"experiment": str, "seed": int}

COMM_HOOKS = (None, "fp16_compress", "bf16_compress", "powersgd")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


# ----------------------------------------------------------------------------- compose


def group_options(group: str) -> list[str]:
    """The yaml files of one config group, i.e. the valid `group=option` choices."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def compose(overrides: list[str]) -> DictConfig:
    """Hydra-compose conf/train.yaml with the user's overrides; Hydra errors -> ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="loom"):
            return hydra_compose("train", overrides=list(overrides))
    except MissingConfigException as e:
        missing = (e.missing_cfg_file or "").strip("/")
        group, _, option = missing.rpartition("/")
        if group and e.options:
            raise ConfigError(
                f"Invalid config: {group}={option} is not a known {group}. "
                f"Valid choices for {group}: {', '.join(e.options)} (files in conf/{group}/)."
            ) from None
        raise ConfigError(f"Invalid config: {str(e).splitlines()[0]}") from None
    except OverrideParseException as e:
        raise ConfigError(
            f"Invalid override syntax: {str(e).splitlines()[0]}. Overrides look like key=value, "
            "group=option or key='[a,b]'."
        ) from None
    except HydraException as e:
        key = getattr(e.__cause__, "full_key", None)
        if key:
            raise ConfigError(_unknown_key_message(key, _override_value(overrides, key))) from None
        raise ConfigError(f"Invalid config: {' '.join(str(e).split())}") from None


def _override_value(overrides: list[str], key: str) -> str | None:
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == key:
            return v
    return None


def _unknown_key_message(full_key: str, value: Any, valid: list[str] | None = None) -> str:
    parent, _, leaf = full_key.rpartition(".")
    if valid is None:
        valid = _valid_keys(parent)
    shown = f"={value}" if value is not None else ""
    where = f"under {parent}" if parent else "at the top level"
    return (
        f"Invalid config: unknown key {full_key}{shown}. Valid keys {where}: {', '.join(valid)}."
    )


def _valid_keys(parent: str) -> list[str]:
    if not parent:
        return sorted([*TOP_LEVEL, *SECTIONS, *GROUPS])
    if parent in SECTIONS:
        return [f.name for f in dataclasses.fields(SECTIONS[parent])]
    if parent in SCHEMAS:  # a group: the keys of any of its options' schemas
        names: dict[str, None] = {}
        for schema in SCHEMAS[parent].values():
            names.update((f.name, None) for f in dataclasses.fields(schema))
        return list(names)
    return []


# ----------------------------------------------------------------------------- validate


def validate(cfg: DictConfig) -> DictConfig:
    """Type every section with its schema and run the cross-field checks.

    Returns a new, plain (non-struct) config with defaults filled in.
    """
    _check_targets(cfg)
    _check_secrets(cfg)
    out: dict[str, Any] = {}
    known = {*TOP_LEVEL, *SECTIONS, *GROUPS}
    for key in cfg:
        if key not in known:
            raise ConfigError(_unknown_key_message(str(key), cfg[key], _valid_keys("")))
    for key, typ in TOP_LEVEL.items():
        val = cfg.get(key)
        if not isinstance(val, typ) or isinstance(val, bool):
            raise ConfigError(
                f"Invalid config: {key}={val!r} must be of type {typ.__name__}."
            )
        out[key] = val
    for section, schema in SECTIONS.items():
        out[section] = _typed(section, schema, cfg.get(section, {}))
    for group in GROUPS:
        node = cfg.get(group)
        name = node.get("name") if isinstance(node, DictConfig) else None
        schemas = SCHEMAS[group]
        schema = schemas.get(name) or schemas.get("*")
        if schema is None:
            raise ConfigError(
                f"Invalid config: {group}.name={name!r} has no schema in Loom. "
                f"Valid choices for {group}: {', '.join(sorted(schemas))}."
            )
        out[group] = _typed(group, schema, node)
    result = OmegaConf.create(out)
    _check(result)
    return result


def _check_secrets(cfg: DictConfig) -> None:
    """A secret may only reach a run through the environment: nothing Loom writes holds it."""
    from loom.secrets import secret_literals

    found = secret_literals(OmegaConf.to_container(cfg, resolve=False))
    if found:
        key = found[0]
        raise ConfigError(
            f"Invalid config: {key} looks like a secret and was given as a value; Loom never writes "
            f"secrets into a run's files. Pass it from the environment instead: "
            f"{key}='${{oc.env:MY_SECRET_VAR}}' (each process reads its own environment)."
        )


def _check_targets(cfg: DictConfig) -> None:
    """Refuse any `_target_` outside the allow-list, before anything is instantiated."""
    from loom.security import ALLOWED_PREFIXES, disallowed_targets

    bad = disallowed_targets(OmegaConf.to_container(cfg, resolve=False))
    if bad:
        key, value = bad[0]
        raise ConfigError(
            f"Invalid config: {key}={value} is not allowed: `_target_` may only name code under "
            f"{', '.join(ALLOWED_PREFIXES)} or a prefix the user allows on the command line with "
            f"security.allow_targets='[my_pkg.]'. Nothing was instantiated."
        )


def _typed(prefix: str, schema: type, node: Any) -> DictConfig:
    """Merge `node` onto the schema; OmegaConf errors become one-paragraph ConfigErrors."""
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, node if node is not None else {})
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
            value = OmegaConf.select(node, str(e.full_key)) if e.full_key else None
            valid = [f.name for f in dataclasses.fields(schema)]
            raise ConfigError(_unknown_key_message(key, value, valid)) from None
        value = OmegaConf.select(node, str(e.full_key), default=None) if e.full_key else None
        expected = _field_type(schema, str(e.full_key))
        raise ConfigError(
            f"Invalid config: {key}={value!r} has the wrong type; expected {expected}."
        ) from None
    out = OmegaConf.create(OmegaConf.to_container(merged))
    return out


def _field_type(schema: type, name: str) -> str:
    for f in dataclasses.fields(schema):
        if f.name == name.split(".")[0]:
            return str(f.type).replace("typing.", "")
    return "a value of the schema's type"


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"Invalid config: {key}={value!r}: {rule}.")


def _check(cfg: DictConfig) -> None:
    """Range and cross-field checks: what types alone cannot say."""
    positive = [
        "trainer.max_steps",
        "trainer.accumulate_grad_batches",
        "trainer.log_every_n_steps",
        "dataset.batch_size",
        "hardware.devices",
        "hardware.num_nodes",
        "checkpoint.keep_last",
    ]
    for key in positive:
        v = OmegaConf.select(cfg, key)
        _require(v >= 1, key, v, "must be a positive integer (>= 1)")
    for key in ("trainer.val_every_n_steps", "checkpoint.every_n_steps", "hardware.max_restarts",
                "trainer.limit_val_batches", "hardware.dataloader_workers"):
        v = OmegaConf.select(cfg, key)
        _require(v >= 0, key, v, "must be >= 0 (0 disables it)")
    _require(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
    _require(cfg.trainer.gradient_clip_val >= 0, "trainer.gradient_clip_val",
             cfg.trainer.gradient_clip_val, "must be >= 0 (0 disables clipping)")
    _require(cfg.hardware.accelerator in ("cpu", "gpu"), "hardware.accelerator",
             cfg.hardware.accelerator, "valid choices: cpu, gpu")
    _require(cfg.hardware.precision in PRECISIONS, "hardware.precision",
             cfg.hardware.precision, f"valid choices: {', '.join(PRECISIONS)}")
    _require(cfg.checkpoint.keep_last >= 2, "checkpoint.keep_last", cfg.checkpoint.keep_last,
             "must be >= 2 so the previous checkpoint survives while the next is written")
    if cfg.run.id is not None:
        rid = str(cfg.run.id)
        _require(bool(rid) and all(c.isalnum() or c in "-_." for c in rid) and not rid.startswith("."),
                 "run.id", rid, "use letters, digits, '-', '_' and '.' only")
    _require(bool(cfg.experiment) and "/" not in cfg.experiment and not cfg.experiment.startswith("."),
             "experiment", cfg.experiment, "must be a plain directory name")

    _check_hardware(cfg)
    _check_dataset(cfg)
    _check_model(cfg)
    _check_strategy(cfg)


PEAK_KEYS = ("bf16", "fp16", "tf32", "fp32")
BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("torchrun", "slurm")


def _check_hardware(cfg: DictConfig) -> None:
    """Hardware profile checks (beyond types and the positive counts above).

    Only the profile's own consistency: whether this machine can run it is
    `loom.hardware.check_machine`, called by `loom train` (not by `loom plan`).
    """
    hw = cfg.hardware
    gpu = hw.accelerator == "gpu"
    _require(hw.backend in BACKENDS, "hardware.backend", hw.backend,
             f"valid choices: {', '.join(BACKENDS)} (nccl on GPUs, gloo on CPUs)")
    _require(gpu or hw.backend != "nccl", "hardware.backend", hw.backend,
             f"nccl needs GPUs but hardware.accelerator={hw.accelerator}; set hardware.backend=gloo")
    _require(hw.launcher in LAUNCHERS, "hardware.launcher", hw.launcher,
             f"valid choices: {', '.join(LAUNCHERS)}")
    if gpu and hw.precision.startswith("bf16"):
        _require(hw.bf16_supported, "hardware.precision", hw.precision,
                 f"hardware={hw.name} ({hw.device_name}) has no bf16 support "
                 "(hardware.bf16_supported=false; bf16 needs Ampere or later); "
                 "set hardware.precision=16-mixed or hardware.precision=32-true")
    for key, val in (hw.peak_tflops or {}).items():
        _require(key in PEAK_KEYS, f"hardware.peak_tflops.{key}", val,
                 f"unknown precision key; valid keys: {', '.join(PEAK_KEYS)}")
        _require(val is None or val > 0, f"hardware.peak_tflops.{key}", val,
                 "must be > 0 (TFLOP/s per device; leave the key out when unknown)")
    for key in ("device_memory_gb", "host_memory_gb"):
        val = hw[key]
        _require(val is None or val > 0, f"hardware.{key}", val, "must be > 0 (GB)")
    _require(hw.cpu_cores >= 1, "hardware.cpu_cores", hw.cpu_cores, "must be >= 1")
    if hw.rdzv_endpoint is not None:
        host, _, port = str(hw.rdzv_endpoint).rpartition(":")
        _require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "hardware.rdzv_endpoint",
                 hw.rdzv_endpoint, "must be host:port, e.g. hardware.rdzv_endpoint=node0.cluster:29500")
    if hw.num_nodes > 1 and hw.launcher == "torchrun":
        _require(hw.rdzv_endpoint is not None, "hardware.rdzv_endpoint", hw.rdzv_endpoint,
                 f"hardware.num_nodes={hw.num_nodes} needs a rendezvous endpoint that every node "
                 "reaches; set hardware.rdzv_endpoint=<host of node 0>:29500 and run the same "
                 "`loom train` command on every node")
    if hw.min_nodes is not None:
        _require(1 <= hw.min_nodes <= hw.num_nodes, "hardware.min_nodes", hw.min_nodes,
                 f"must be between 1 and hardware.num_nodes={hw.num_nodes} (torchrun --nnodes=min:max), "
                 "or null for a fixed number of nodes")
    if hw.launcher == "slurm":
        _require(hw.slurm is not None, "hardware.slurm", hw.slurm,
                 "hardware.launcher=slurm needs a hardware.slurm block (partition, account, "
                 "time_limit, ...); start from conf/hardware/slurm.yaml")
    if hw.slurm is not None:
        sl = hw.slurm
        _require(_slurm_time(str(sl.time_limit)), "hardware.slurm.time_limit", sl.time_limit,
                 "must be [D-]HH:MM:SS or minutes, as sbatch --time takes it, e.g. 04:00:00")
        if sl.gpus_per_node is not None:
            _require(sl.gpus_per_node == hw.devices, "hardware.slurm.gpus_per_node", sl.gpus_per_node,
                     f"must equal hardware.devices={hw.devices} (one process per GPU), or be null")
        for key in ("cpus_per_task", "mem_gb"):
            val = sl[key]
            _require(val is None or val > 0, f"hardware.slurm.{key}", val, "must be > 0 or null")
        from loom.slurm import check_allocation

        check_allocation(cfg)


def _slurm_time(text: str) -> bool:
    days, _, rest = text.rpartition("-")
    if days and not days.isdigit():
        return False
    parts = rest.split(":")
    return 1 <= len(parts) <= 3 and all(p.isdigit() for p in parts)


def _check_strategy(cfg: DictConfig) -> None:
    """Strategy options and their fit with the hardware (world size, TP size...)."""
    if cfg.strategy.name == "single":
        _require(cfg.hardware.devices * cfg.hardware.num_nodes == 1, "hardware.devices",
                 cfg.hardware.devices, "strategy=single runs one process: set hardware.devices=1 "
                 "(and hardware.num_nodes=1) or choose strategy=ddp")
    if cfg.strategy.name == "ddp":
        _require(cfg.strategy.comm_hook in COMM_HOOKS, "strategy.comm_hook", cfg.strategy.comm_hook,
                 "valid choices: null, " + ", ".join(str(h) for h in COMM_HOOKS[1:]))
        _require(cfg.strategy.bucket_cap_mb >= 1, "strategy.bucket_cap_mb",
                 cfg.strategy.bucket_cap_mb, "must be >= 1")
    if cfg.strategy.name in ("fsdp", "fsdp_tp"):
        _check_model_parallel(cfg)
    if cfg.strategy.name in ZERO_STAGES:
        _check_zero(cfg)


# The module classes of Loom's GPT (loom.models.gpt), named here because validation runs
# before torch is imported: the choices for strategy.shard_units.
GPT_MODULE_CLASSES = ("Block", "CausalSelfAttention", "MLP", "Linear", "Embedding", "LayerNorm")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3}


def _check_model_parallel(cfg: DictConfig) -> None:
    """fsdp / fsdp_tp: sharding units exist in the model; the TP size fits devices and heads."""
    s, hw, model = cfg.strategy, cfg.hardware, cfg.model
    is_gpt = str(model.name).startswith("gpt")
    if s.shard_units is not None:
        units = list(s.shard_units)
        _require(len(units) > 0, "strategy.shard_units", units,
                 "list at least one module class name, or null for the model's default (GPT: Block)")
        if is_gpt:
            bad = [u for u in units if u not in GPT_MODULE_CLASSES]
            _require(not bad, "strategy.shard_units", units,
                     f"{', '.join(map(str, bad))} is not a module class of model={model.name}; "
                     f"valid choices: {', '.join(GPT_MODULE_CLASSES)}")
    mp_precisions = ("32-true", "bf16-mixed", "bf16-true", "16-true")
    _require(hw.precision in mp_precisions, "hardware.precision", hw.precision,
             f"strategy={s.name} (Lightning's ModelParallelStrategy) supports "
             f"{', '.join(mp_precisions)}; use bf16-mixed or a ZeRO/DDP strategy for 16-mixed")
    if s.name != "fsdp_tp":
        return
    tp, world = s.tensor_parallel, hw.devices * hw.num_nodes
    _require(tp >= 1, "strategy.tensor_parallel", tp, "must be a positive integer (>= 1)")
    _require(hw.devices % tp == 0, "strategy.tensor_parallel", tp,
             f"must divide hardware.devices={hw.devices} (tensor-parallel groups stay within a node); "
             f"valid choices: {', '.join(str(d) for d in range(1, hw.devices + 1) if hw.devices % d == 0)}")
    _require(world % tp == 0, "strategy.tensor_parallel", tp, f"must divide the world size {world}")
    _require(is_gpt, "model.name", model.name,
             "strategy=fsdp_tp needs a model with a tensor-parallel plan; models with one: gpt_*. "
             "Use strategy=fsdp for this model")
    _require(model.n_head % tp == 0, "strategy.tensor_parallel", tp,
             f"must divide model.n_head={model.n_head} (each tensor-parallel rank holds whole heads)")


def _check_zero(cfg: DictConfig) -> None:
    """DeepSpeed ZeRO: offload options per stage, the user's JSON, host memory for offload."""
    s, hw = cfg.strategy, cfg.hardware
    stage = ZERO_STAGES[s.name]
    _require(not s.offload_params or stage == 3, "strategy.offload_params", s.offload_params,
             f"parameter offload needs ZeRO stage 3 (strategy=zero3 or zero3_offload), not strategy={s.name}")
    if s.name == "zero3_offload":
        _require(s.offload_optimizer, "strategy.offload_optimizer", s.offload_optimizer,
                 "strategy=zero3_offload is ZeRO-3 with the optimizer on the host; "
                 "use strategy=zero3 for no offload")
    from loom.strategies import resolved_deepspeed_config

    if s.deepspeed_config:  # frozen as an absolute path: ranks and resumes may run elsewhere
        s.deepspeed_config = str(Path(s.deepspeed_config).expanduser().resolve())
    resolved_deepspeed_config(cfg)  # raises ConfigError for a missing, malformed or conflicting JSON
    if s.offload_optimizer or s.offload_params:
        from loom.models.spec import model_spec

        params = model_spec(cfg).params
        world = hw.devices * hw.num_nodes
        # ZeRO-Offload keeps the fp32 master copy + Adam m and v on the host: 12 bytes per
        # parameter, partitioned over all ranks; one node hosts `devices` partitions.
        per_param = 12 + (4 if s.offload_params else 0)
        need = per_param * params / world * hw.devices
        have = hw.host_memory_gb * 1e9 * 0.8
        _require(need <= have, "hardware.host_memory_gb", hw.host_memory_gb,
                 f"strategy={s.name} keeps {need / 1e9:,.1f} GB of optimizer state"
                 f"{' and parameters' if s.offload_params else ''} in host memory per node "
                 f"({per_param} bytes x {params / 1e6:,.1f}M params x {hw.devices}/{world} ranks), "
                 f"more than 80% of hardware.host_memory_gb; use more nodes, a smaller model, "
                 f"or a profile with more host memory")


def _check_dataset(cfg: DictConfig) -> None:
    """loom.data.check: paths, columns, caches, tokenizer (torch-free; see there)."""
    from loom.data.check import check_dataset

    check_dataset(cfg)


def _check_model(cfg: DictConfig) -> None:
    """loom.models.check: sizes vs context and vocabulary, model x dataset fit, and a custom
    `_target_` that must import as a LightningModule / nn.Module. Importing the user's module
    is the only way torch can load here (only if that module imports it)."""
    from loom.models.check import check_model

    check_model(cfg)


def frozen_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as config.yaml holds it: secret-keyed `${oc.env:NAME}` references
    stay unresolved (each process reads its own environment; no file holds the secret), and
    any other secret-looking value is redacted."""
    from loom.secrets import redact, restore_env_refs, split_env_refs

    masked, refs = split_env_refs(OmegaConf.to_container(cfg, resolve=False))
    resolved = OmegaConf.to_container(OmegaConf.create(masked), resolve=True)
    return redact(restore_env_refs(resolved, refs))


def load_frozen(path: Path) -> DictConfig:
    """Read a run's frozen config.yaml (no Hydra, no validation: it was validated once)."""
    return OmegaConf.load(path)
