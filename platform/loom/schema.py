"""The typed schema of the run config's own sections, and the merge that types any node.

Config groups (hardware/, strategies/, data/, models/, optim/, tracking/, eval/, objectives/) each hold the
schemas of their options beside their checks; this module holds what is not a group (run,
trainer, checkpoint, security, sweep, and the top-level keys) and `typed`, which every
schema goes through. No torch, no Hydra: the CLI's first second depends on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loom.errors import ConfigError

# The config groups of conf/ (the `group=option` choices), in the order they are checked.
GROUPS = ("hardware", "strategy", "dataset", "model", "optim", "tracking", "eval", "objective", "float8")


@dataclass
class RunConfig:
    id: str | None = None
    root: str = "runs"
    sweep_dir: str | None = None  # set by a sweep: its trials' run dirs live there
    dir: str | None = None        # the exact run dir (hydra.run.dir=X sets it); null: <root>/<experiment>/<id>


@dataclass
class SweepConfig:
    params: dict[str, str] = field(default_factory=dict)  # key -> Hydra sweep syntax, e.g. "ddp,zero2"
    sampler: str = "grid"         # grid | optuna
    n_trials: int = 8             # optuna
    objective: str = "final_loss"  # a summary.json metric (optuna)
    direction: str = "minimize"
    seed: int = 0


# What a sweep (and `loom report SWEEP --objective`) may rank its trials by: summary.json metrics.
SUMMARY_METRICS = ("final_loss", "validation.loss", "validation.acc", "throughput.tokens_per_sec",
                   "throughput.samples_per_sec", "throughput.mfu", "throughput.tflops_per_device",
                   "train_time_s", "wall_time_s")
# How the report ranks by one when no direction is given: rates and accuracy up, losses and times down.
MAXIMIZED = ("validation.acc", "throughput.tokens_per_sec", "throughput.samples_per_sec", "throughput.mfu",
             "throughput.tflops_per_device")
# ... or by an evaluation score, `eval/<task>/<metric>` (the last evaluation's; summary.json `eval`).
EVAL_OBJECTIVE = "eval/"
# lm-eval's metrics, by the direction that is better (a metric's filter suffix, `exact_match_strict-match`,
# goes with its metric): scores up, perplexities and bits down.
EVAL_DIRECTIONS = {
    **dict.fromkeys(("acc", "acc_norm", "acc_mutual_info", "exact_match", "f1", "mcc", "bleu", "chrf", "ter_inverse",
                     "rouge1", "rouge2", "rougeL", "rougeLsum", "em", "pass_at_1", "contains"), "maximize"),
    **dict.fromkeys(("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter"), "minimize"),
}


def eval_objective(name: str) -> tuple[str, str] | None:
    """(task, metric) of an `eval/<task>/<metric>` objective; None for a summary.json metric or a malformed one."""
    if not name.startswith(EVAL_OBJECTIVE):
        return None
    task, _, metric = name[len(EVAL_OBJECTIVE):].rpartition("/")
    return (task, metric) if task and metric else None


def objective_direction(name: str) -> str | None:
    """The better direction of an objective, from MAXIMIZED or EVAL_DIRECTIONS (None: an eval metric not
    in the table: sweep.direction must say)."""
    pair = eval_objective(name)
    if pair is None:
        return "maximize" if name in MAXIMIZED else "minimize"
    metric = pair[1]
    known = sorted((m for m in EVAL_DIRECTIONS if metric == m or metric.startswith(m + "_")), key=len)
    return EVAL_DIRECTIONS[known[-1]] if known else None


def objective_problem(name: str, tasks: list[str], named: set[str]) -> str | None:
    """Why `name` cannot rank trials (None: it can): a summary.json metric, or `eval/<task>/<metric>` with
    `<task>` one that eval.tasks (`tasks`) evaluates (`named`: the names, with those its task YAMLs give)."""
    if name in SUMMARY_METRICS:
        return None
    choices = f"Valid choices: {', '.join(SUMMARY_METRICS)}, or eval/<task>/<metric> for a task in eval.tasks."
    pair = eval_objective(name)
    if pair is None:
        return f"sweep.objective={name!r} is not a summary.json metric. {choices}"
    if pair[0] not in named:
        listed = f"eval.tasks is {list(tasks)}" if tasks else "eval.tasks is empty"
        return (f"sweep.objective={name!r} ranks by task {pair[0]!r}, but {listed}: add it "
                f"(eval.tasks='[{pair[0]}]') or rank by one of {', '.join(sorted(named)) or 'the summary metrics'}.")
    return None


@dataclass
class ProfileConfig:
    # [start, stop): torch.profiler traces of steps start..stop-1 on every rank (<run>/profile/);
    # null: none (or, with memory=true, the first three steps)
    steps: list[int] | None = None
    memory: bool = False   # GPU: a CUDA memory snapshot (memory_viz); CPU: the allocator's peak per phase
    shapes: bool = False   # record operator input shapes
    stacks: bool = False   # record Python stacks (larger traces)


@dataclass
class TrainerConfig:
    max_steps: int = 200
    accumulate_grad_batches: int = 1
    # Samples per optimizer step, a property of the run (null: micro x accumulation x dp of its
    # first launch, recorded at freeze); accumulation is derived from it at every world size.
    global_batch_size: int | None = None
    gradient_clip_val: float | None = 1.0  # 0 or null (`~trainer.gradient_clip_val`): no clipping
    log_every_n_steps: int = 10
    val_every_n_steps: int = 0
    limit_val_batches: int = 8
    activation_checkpointing: str = "none"  # none | selective (every other block) | full (every block)
    compile: bool = False  # torch.compile: each sharding unit (fsdp, fsdp_tp) or the whole model
    gc_every_n_steps: int = 50  # Python GC: off, collected every N steps on every rank (0: Python's own)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # Your own Lightning callbacks, after Loom's: each {_target_: module.Class, ...its arguments}
    # (its module named in security.allow_targets); instantiated on every rank by the worker.
    callbacks: list[Any] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    every_n_steps: int = 100
    keep_last: int = 2
    async_: bool = False        # the YAML key is `async` (see _keyword_field)
    export_dtype: str = "fp32"  # final/model.safetensors: fp32 | bf16 | fp16
    export_format: str = "loom"  # loom: final/model.safetensors | hf: final/ loads with from_pretrained
    export_shard_gb: float = 5.0  # export_format=hf: the largest shard file


def _keyword_field(schema: type, attr: str, key: str) -> None:
    """Give the dataclass field `attr` the name `key`, a Python keyword no field can be declared
    with (`dataclasses.make_dataclass` refuses keywords too). OmegaConf reads a schema through
    `dataclasses.fields` and the annotations, never through `__init__`, so after this the user
    types, the frozen config shows and Loom reads `checkpoint.async` (as `cfg.checkpoint["async"]`).
    Section schemas are never instantiated, so the generated `__init__`'s `async_` is unused."""
    fields = schema.__dataclass_fields__  # type: ignore[attr-defined]
    fields[attr].name = key
    schema.__dataclass_fields__ = {key if k == attr else k: v for k, v in fields.items()}  # type: ignore[attr-defined]
    schema.__annotations__ = {key if k == attr else k: v for k, v in schema.__annotations__.items()}


_keyword_field(CheckpointConfig, "async_", "async")


@dataclass
class SecurityConfig:
    allow_targets: list[str] = field(default_factory=list)


@dataclass
class KubernetesConfig:
    """hardware.launcher=kubernetes: the Kubeflow Trainer TrainJob `loom train` renders and submits
    (loom.launch.kubernetes). Launch settings, not part of the run: a resubmission resumes it."""

    image: str | None = None           # the container image with Loom installed (required)
    namespace: str = "default"
    runtime: str = "torch-distributed"  # the ClusterTrainingRuntime the TrainJob references
    pvc: str | None = None             # the PersistentVolumeClaim holding run.root (required)
    mount: str = "/runs"               # where every pod mounts it (and this machine sees it): run.root is under it
    submit: bool | None = None         # null: submit when a kube context is configured, else render only
    gpus_per_node: int | None = None   # GPUs of the cluster's nodes (null: hardware.devices)
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str | None = None             # per pod, Kubernetes quantities ("32", "500Gi"); null: none asked
    memory: str | None = None
    credentials_from: str | None = None  # a Secret: each of credential_keys becomes that env var
    credential_keys: list[str] = field(default_factory=lambda: ["WANDB_API_KEY"])
    env: dict[str, str] = field(default_factory=dict)  # plain env vars of the pods (no credentials)
    python: str = "python"             # the image's interpreter
    termination_grace_s: int = 180     # SIGTERM to SIGKILL: the ranks' checkpoint on a stop


# How a section takes a secret instead of a value, where it is not `${oc.env:NAME}` (validate's
# refusal of a literal secret says it): a pod's environment comes from the cluster, not this shell.
SECRET_ADVICE: dict[str, str] = {
    "kubernetes.env.": "credentials reach the pods from a Kubernetes Secret only: drop kubernetes.env.{name} and "
                       "set kubernetes.credentials_from=<Secret name> (kubernetes.credential_keys=[{name}] names "
                       "the Secret's keys, each becoming that environment variable)",
}


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "security": SecurityConfig,
    "sweep": SweepConfig,
    "kubernetes": KubernetesConfig,
}
TOP_LEVEL = {"experiment": str, "seed": int}
NULLABLE_TOP_LEVEL = {"experiment"}  # null: the model's family (loom.models.experiment_of)


def load(ref: str) -> Any:
    """The object a registry entry names as "module:attribute": imported only when a worker builds
    it, so the registries (and the launcher reading them) stay free of torch."""
    import importlib

    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def no_check(cfg: DictConfig, layout: object) -> None:
    """The default `check` of a config group option: nothing beyond its schema's types."""


def nothing_to_fill(cfg: DictConfig) -> None:
    """The default `normalize` of a config group option: its values are used as written."""


def field_names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def unknown_key_message(full_key: str, value: Any, valid: list[str], key_notes: dict[str, str] | None = None) -> str:
    """The refusal of an unknown key; `key_notes`: what a key that some options of a group have
    means for the others (the groups' own, e.g. loom.models.KEY_NOTES), appended."""
    parent, _, _ = full_key.rpartition(".")
    shown = f"={value}" if value is not None else ""
    where = f"under {parent}" if parent else "at the top level"
    notes = [n for k, n in (key_notes or {}).items() if full_key == k or full_key.startswith(f"{k}.")]
    return (f"Invalid config: unknown key {full_key}{shown}. Valid keys {where}: {', '.join(valid)}."
            + "".join(f" {n}." for n in notes))


def typed(prefix: str, schema: type, node: Any) -> DictConfig:
    """Merge `node` onto the schema; OmegaConf errors become one-paragraph ConfigErrors.
    Returns a plain (non-struct) config with the schema's defaults filled in."""
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, node if node is not None else {})
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
            value = OmegaConf.select(node, str(e.full_key)) if e.full_key else None
            raise ConfigError(unknown_key_message(key, value, field_names(schema))) from None
        value = OmegaConf.select(node, str(e.full_key), default=None) if e.full_key else None
        raise ConfigError(
            f"Invalid config: {key}={value!r} has the wrong type; expected {_field_type(schema, str(e.full_key))}."
        ) from None
    return OmegaConf.create(OmegaConf.to_container(merged))


def _field_type(schema: type, name: str) -> str:
    for f in dataclasses.fields(schema):
        if f.name == name.split(".")[0]:
            return str(f.type).replace("typing.", "")
    return "a value of the schema's type"
