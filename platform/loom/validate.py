"""Stage 2, validate: type every section with its schema, normalize, then check.

Four explicit passes over a copy of the composed config:
  1. refuse what must never reach a run: `_target_`s outside the allow-list, literal secrets;
  2. type: each section and group option merged onto its schema (defaults filled in);
  3. normalize: each group fills what the user left to it (absolute paths, sizes from the
     data): the frozen config shows the result, and the checks only read;
  4. check: the run's own sections, then each group's checks with the parallel layout.
Anything invalid is a ConfigError (exit 2) naming the full key, the value and the choices.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom import strategies
from loom.compose import GROUP_PACKAGES, valid_keys
from loom.errors import ConfigError, require
from loom.packages import PACKAGES, TRAINING, VALIDATION, Need, check_needs
from loom.redaction import secret_literals
from loom.schema import (
    EVAL_OBJECTIVE,
    GROUPS,
    NULLABLE_TOP_LEVEL,
    SECRET_ADVICE,
    SECTIONS,
    TOP_LEVEL,
    objective_problem,
    typed,
    unknown_key_message,
)
from loom.target_allowlist import ALLOWED_PREFIXES, disallowed_targets

# Group checks run in this order (the first failure is the one reported).
CHECK_ORDER = ("optim", "hardware", "dataset", "model", "strategy", "tracking", "eval", "objective", "float8")


# The run's own sections' rows of loom.packages' table (the groups hand theirs as `NEEDS`).
NEEDS: tuple[Need, ...] = (
    Need("sweep.sampler=optuna (hydra/sweeper=optuna)", lambda cfg: cfg.sweep.sampler == "optuna", "optuna",
         example=("sweep.sampler=optuna",), checked=TRAINING),
)


def package_needs() -> tuple[Need, ...]:
    """The whole table: which option needs which optional package (docs/install.md)."""
    return (*NEEDS, *(need for group in GROUP_PACKAGES.values() for need in getattr(group, "NEEDS", ())))


def needs_table() -> str:
    """docs/install.md's table of optional packages (tests/test_packages.py holds the page to it)."""
    rows = ["| option | needs | from | refused by |", "|---|---|---|---|"]
    for need in package_needs():
        pip_name, extra = PACKAGES[need.module]
        when = "`loom train`" if need.checked == TRAINING else "validation (`loom plan`, `loom train`)"
        rows.append(f"| `{need.option}` | {pip_name} | `loom[{extra}]` | {when} |")
    return "\n".join(rows)


def validate(cfg: DictConfig) -> DictConfig:
    """The typed, normalized and checked config of one run (a new object; `cfg` is untouched).
    Optional packages are checked before any group normalizes: a missing one is named, not met
    as a failure to read what it would have read."""
    _refuse_targets(cfg)
    _refuse_secrets(cfg)
    out = typed_config(cfg)
    check_needs(out, package_needs(), VALIDATION)
    normalize(out)
    check(out)
    return out


def with_strategy(valid: DictConfig, node: DictConfig) -> DictConfig:
    """A validated config with another strategy node, typed, normalized and checked as `validate`
    would (`loom plan --compare` weighs many: the other sections are typed once)."""
    out = valid.copy()
    schemas = GROUP_PACKAGES["strategy"].SCHEMAS
    name = node.get("name")
    schema = schemas.get(name) or schemas.get("*")
    if schema is None:
        raise ConfigError(f"Invalid config: strategy.name={name!r} has no schema in Loom. "
                          f"Valid choices for strategy: {', '.join(sorted(schemas))}.")
    out.strategy = typed("strategy", schema, node)
    GROUP_PACKAGES["strategy"].normalize(out)
    check(out)
    return out


def typed_config(cfg: DictConfig) -> DictConfig:
    out: dict[str, Any] = {}
    for key in cfg:
        if key not in {*TOP_LEVEL, *SECTIONS, *GROUPS}:
            raise ConfigError(unknown_key_message(str(key), cfg[key], valid_keys("")))
    for key, typ in TOP_LEVEL.items():
        val = cfg.get(key)
        if val is None and key in NULLABLE_TOP_LEVEL:
            out[key] = val
            continue
        if not isinstance(val, typ) or isinstance(val, bool):
            raise ConfigError(f"Invalid config: {key}={val!r} must be of type {typ.__name__}.")
        out[key] = val
    for section, schema in SECTIONS.items():
        out[section] = typed(section, schema, cfg.get(section, {}))
    for group in GROUPS:
        node = cfg.get(group)
        name = node.get("name") if isinstance(node, DictConfig) else None
        schemas = GROUP_PACKAGES[group].SCHEMAS
        schema = schemas.get(name) or schemas.get("*")
        if schema is None:
            raise ConfigError(
                f"Invalid config: {group}.name={name!r} has no schema in Loom. "
                f"Valid choices for {group}: {', '.join(sorted(schemas))}."
            )
        out[group] = typed(group, schema, node)
    return OmegaConf.create(out)


def normalize(cfg: DictConfig) -> None:
    """Each group fills in what it derives (in place, on validate's own copy)."""
    for group in GROUPS:
        GROUP_PACKAGES[group].normalize(cfg)
    _normalize_global_batch(cfg)


def _normalize_global_batch(cfg: DictConfig) -> None:
    """`trainer.global_batch_size` set: the accumulation is derived from it (an explicit, different
    accumulation is a contradiction). Null stays null: freeze records the first launch's."""
    from loom.strategies.world import derive_accumulation

    gbs, given = cfg.trainer.global_batch_size, cfg.trainer.accumulate_grad_batches
    if gbs is None:
        return
    require(isinstance(gbs, int) and gbs >= 1, "trainer.global_batch_size", gbs,
            "must be a positive integer, or null (micro batch x accumulation x data-parallel ranks)")
    accum = derive_accumulation(cfg, gbs)
    require(given in (1, accum), "trainer.accumulate_grad_batches", given,
            f"contradicts trainer.global_batch_size={gbs}, which takes {accum} at this world; "
            "set one of the two")


def check(cfg: DictConfig) -> None:
    _check_sections(cfg)
    layout = strategies.layout_of(cfg)
    for group in CHECK_ORDER:
        GROUP_PACKAGES[group].check(cfg, layout)
    _check_objective(cfg)


def evaluated_tasks(cfg: DictConfig) -> tuple[list[str], set[str]]:
    """(eval.tasks, the task names they evaluate: each name, and the tasks of each listed YAML or folder)."""
    from loom.eval.registry import split

    tasks = [str(t) for t in (cfg.get("eval") or {}).get("tasks") or []]
    return tasks, {*tasks, *split(tasks)[0]}


def _check_objective(cfg: DictConfig) -> None:
    """sweep.objective=eval/<task>/<metric> names a task eval.tasks evaluates (a sweep refuses it before
    any trial; a single run's config alike). Summary metrics are checked by the sweep, which ranks by them."""
    objective = str(cfg.sweep.objective)
    problem = objective_problem(objective, *evaluated_tasks(cfg)) if objective.startswith(EVAL_OBJECTIVE) else None
    if problem is not None:
        raise ConfigError(f"Invalid config: {problem}")


def _check_sections(cfg: DictConfig) -> None:
    """The run's own sections (trainer, checkpoint, run, experiment): ranges types cannot say."""
    for key in ("trainer.max_steps", "trainer.accumulate_grad_batches", "trainer.log_every_n_steps",
                "checkpoint.keep_last"):
        v = OmegaConf.select(cfg, key)
        require(v >= 1, key, v, "must be a positive integer (>= 1)")
    for key in ("trainer.val_every_n_steps", "checkpoint.every_n_steps", "trainer.limit_val_batches",
                "trainer.gc_every_n_steps"):
        v = OmegaConf.select(cfg, key)
        require(v >= 0, key, v, "must be >= 0 (0 disables it)")
    clip = cfg.trainer.gradient_clip_val
    require(clip is None or clip >= 0, "trainer.gradient_clip_val", clip,
            "must be >= 0 (0 or null disables clipping)")
    ac, modes = cfg.trainer.activation_checkpointing, ("none", "selective", "full")
    require(ac in modes, "trainer.activation_checkpointing", ac,
            f"valid choices: {', '.join(modes)} (selective: every other block, full: every block)")
    require(cfg.checkpoint.keep_last >= 2, "checkpoint.keep_last", cfg.checkpoint.keep_last,
            "must be >= 2 so the previous checkpoint survives while the next is written")
    _check_profile(cfg)
    _check_callbacks(cfg)
    strategies.check_checkpoint(cfg)  # checkpoint.export_dtype; checkpoint.async where it can run
    strategies.checks.check_compile(cfg)  # trainer.compile where the strategy can run it
    if cfg.run.id is not None:
        rid = str(cfg.run.id)
        require(bool(rid) and all(c.isalnum() or c in "-_." for c in rid) and not rid.startswith("."),
                "run.id", rid, "use letters, digits, '-', '_' and '.' only")
    _check_run_dir(cfg)
    require(bool(cfg.experiment) and "/" not in cfg.experiment and not cfg.experiment.startswith("."),
            "experiment", cfg.experiment, "must be a plain directory name")


def _check_profile(cfg: DictConfig) -> None:
    """trainer.profile.steps: [start, stop) inside the run's steps 1..max_steps."""
    steps, last = cfg.trainer.profile.steps, cfg.trainer.max_steps
    if steps is None:
        return
    ok = (len(steps) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
          and 1 <= steps[0] < steps[1] <= last + 1)
    require(ok, "trainer.profile.steps", list(steps),
            f"must be [start, stop] with 1 <= start < stop <= {last + 1} (trainer.max_steps={last} + 1): "
            "steps start..stop-1 are profiled")


def _check_callbacks(cfg: DictConfig) -> None:
    """trainer.callbacks: each a node naming its class by `_target_` (the allow-list has
    already vetted the module), whose top-level module can be found here without importing it."""
    import importlib.util

    for i, node in enumerate(cfg.trainer.callbacks):
        key = f"trainer.callbacks[{i}]"
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        require(isinstance(target, str) and "." in target, key, node,
                "give {_target_: module.Class, ...its arguments}: a Lightning Callback built on every rank")
        top = target.split(".")[0]
        require(importlib.util.find_spec(top) is not None, f"{key}._target_", target,
                f"module {top!r} cannot be found on this Python's path (PYTHONPATH)")


def _check_run_dir(cfg: DictConfig) -> None:
    """`run.dir` (hydra.run.dir) names one run's dir: a fixed path, and never a sweep's trials,
    which each need their own (they live under <run.root>/<experiment>/sweeps/<id>/)."""
    d = cfg.run.dir
    if d is None:
        return
    require(bool(str(d).strip()), "run.dir", d, "give a directory, or null for <run.root>/<experiment>/<run id>")
    if cfg.run.sweep_dir is not None or cfg.sweep.params:
        raise ConfigError(
            f"Invalid config: run.dir={d} (hydra.run.dir) names a single run's dir, but this is a sweep whose "
            "trials each need their own run dir. Drop it; set run.root=<dir> (and experiment=<name>): the "
            "trials then live under <run.root>/<experiment>/sweeps/<id>/.")


def _refuse_targets(cfg: DictConfig) -> None:
    """Refuse any `_target_` outside the allow-list, before anything is instantiated."""
    bad = disallowed_targets(OmegaConf.to_container(cfg, resolve=False))
    if bad:
        key, value = bad[0]
        raise ConfigError(
            f"Invalid config: {key}={value} is not allowed: `_target_` may only name code under "
            f"{', '.join(ALLOWED_PREFIXES)} or a prefix the user allows on the command line with "
            f"security.allow_targets='[my_pkg.]'. Nothing was instantiated."
        )


def _refuse_secrets(cfg: DictConfig) -> None:
    """A secret may only reach a run through the environment: nothing Loom writes holds it."""
    found = secret_literals(OmegaConf.to_container(cfg, resolve=False))
    if found:
        key = found[0]
        advice = next((a.format(name=key[len(prefix):]) for prefix, a in SECRET_ADVICE.items()
                       if key.startswith(prefix)), None)
        raise ConfigError(
            f"Invalid config: {key} looks like a secret and was given as a value; Loom never writes "
            "secrets into a run's files. " + (f"{advice[0].upper()}{advice[1:]}." if advice else
                                              f"Pass it from the environment instead: {key}='${{oc.env:MY_SECRET_VAR}}' "
                                              "(each process reads its own environment).")
        )
