"""Stage 4, freeze: derive the run id, create the run dir, write config.yaml and plan.json once,
and say whether this command starts, resumes or finds a completed run."""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.atomic import atomic_write_text
from loom.errors import ConfigError
from loom.layout import world_of
from loom.plan import Plan
from loom.rundir.config_file import frozen_container, frozen_yaml
from loom.rundir.extension import extend, is_completed, max_steps_only
from loom.rundir.paths import RunDir
from loom.strategies.world import check_elastic_range, derive_accumulation, world_change_only

# Keys that do not change what a run computes: changing them resumes the same run.
# Activation checkpointing recomputes the same values, profiling only observes, async checkpoints write the same bytes,
# the export dtype and format only shape final/, benchmark evaluation (eval) only reads the model; so a run can also
# resume with checkpointing switched on to fit, and run ids frozen before these keys existed still hold.
VOLATILE = ("run", "tracking", "sweep", "kubernetes", "eval", "hardware.max_restarts", "hardware.rdzv_endpoint",
            "hardware.rdzv_keep_alive_s", "hardware.rdzv_last_call_s",
            "trainer.log_every_n_steps", "trainer.activation_checkpointing", "trainer.profile", "checkpoint.async",
            "checkpoint.export_dtype", "checkpoint.export_format", "checkpoint.export_shard_gb",
            "dataset.cache", "dataset.storage")  # how remote bytes arrive, not which: the store's versions are an input


def identity(cfg: DictConfig) -> dict[str, Any]:
    data = copy.deepcopy(frozen_container(cfg))
    for key in VOLATILE:
        parent, _, leaf = key.rpartition(".")
        node = data
        for part in parent.split(".") if parent else []:
            node = node.get(part, {})
        node.pop(leaf, None)
    for key in ("init_from", "init_from_fingerprint", "vocab_used"):  # null: as frozen before the key existed
        if key in data.get("model", {}) and data["model"][key] is None:
            data["model"].pop(key)
    if data.get("objective") == {"name": "lm"}:  # the default objective: as frozen before the group existed
        data.pop("objective")
    if (data.get("float8") or {}).get("name") == "none":  # no float8: as frozen before the group existed
        data.pop("float8")
    if data.get("trainer", {}).get("global_batch_size", 0) is None:  # null: the run's own (adopt_run_batch)
        data["trainer"].pop("global_batch_size")
    return data


def adopt_run_batch(cfg: DictConfig, old: DictConfig, run_dir: Path) -> None:
    """A command that leaves `trainer.global_batch_size` null continues with the run's (its frozen
    config's; plan.json's `global_batch` for a run frozen before the key existed), the accumulation
    re-derived for this command's world (in place; ConfigError naming usable worlds if none)."""
    gbs = old.trainer.get("global_batch_size")
    if gbs is None:
        gbs = _read_json(RunDir(run_dir).plan).get("global_batch")
        if gbs is None:
            return
        old.trainer.global_batch_size = int(gbs)  # compared as if frozen with it
    if cfg.trainer.get("global_batch_size") is None:
        derive_accumulation(cfg, int(gbs))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def input_fingerprints(cfg: DictConfig) -> dict[str, str]:
    """The content of what the config only names, by the key that names it: the DeepSpeed JSON
    (its bytes), the dataset's files and tokenizer (list, sizes, mtimes), a local model config.
    Recipes need nothing here: their content is composed into the config itself."""
    from loom.data import dataset_fingerprint

    out: dict[str, str] = {}
    files = {"strategy.deepspeed_config": cfg.strategy.get("deepspeed_config"),
             "model.config": cfg.model.get("config")}
    for key, path in files.items():
        p = Path(str(path or "")).expanduser()
        p = p / "config.json" if path and p.is_dir() else p
        if path and p.is_file():
            out[key] = f"{p} sha1 {hashlib.sha1(p.read_bytes()).hexdigest()[:16]}"
    data = dataset_fingerprint(cfg)
    if data:
        out["dataset"] = data
    return out


def run_id(cfg: DictConfig, inputs: dict[str, str] | None = None) -> str:
    """The user's `run.id`, else a hash of everything that shapes the result: the config and
    the content of the files it names (`input_fingerprints`)."""
    if cfg.run.id:
        return str(cfg.run.id)
    inputs = input_fingerprints(cfg) if inputs is None else inputs
    data = {**identity(cfg), **({"inputs": inputs} if inputs else {})}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def inputs_diff(run_dir: Path, inputs: dict[str, str]) -> list[str]:
    """`key: file content changed (frozen -> now)` for each named file whose content differs from
    what plan.json recorded at freeze (run dirs frozen before this record: nothing to compare)."""
    try:
        old = json.loads(RunDir(run_dir).plan.read_text()).get("inputs")
    except (OSError, ValueError):
        old = None
    if not isinstance(old, dict):
        return []
    return [f"{k}: the content changed since the run was frozen ({old.get(k, '<none>')} -> "
            f"{inputs.get(k, '<none>')}; restore it to resume)"
            for k in sorted(set(old) | set(inputs)) if old.get(k) != inputs.get(k)]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every full key whose value differs."""
    a, b = _flat(old), _flat(new)
    missing = object()
    return [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    ]


@dataclass
class Frozen:
    run_dir: Path
    run_id: str
    state: str  # "new" | "resume" | "completed"
    message: str | None = None  # what the launcher says instead of "Resuming run X" (an extension)


def run_dir_of(cfg: DictConfig, rid: str) -> Path:
    if cfg.run.get("dir"):  # `run.dir` / `hydra.run.dir`: exactly there (validate refuses it in sweeps)
        return Path(cfg.run.dir).expanduser().resolve()
    if cfg.run.get("sweep_dir"):
        return (Path(cfg.run.sweep_dir) / rid).resolve()
    return RunDir.of(cfg.run.root, cfg.experiment, rid).path.resolve()


def freeze(cfg: DictConfig, plan: Plan) -> Frozen:
    """Create the run dir and write config.yaml + plan.json once; an existing run is resumed
    (same config) or refused (a different config under the same run.id)."""
    auto_id = not cfg.run.id
    inputs = input_fingerprints(cfg)
    rid = run_id(cfg, inputs)
    cfg = copy.deepcopy(cfg)
    cfg.run.id = rid
    run_dir = run_dir_of(cfg, rid)
    frozen_path = RunDir(run_dir).config
    if frozen_path.exists():
        old = OmegaConf.load(frozen_path)
        adopt_run_batch(cfg, old, run_dir)
        diff = config_diff(identity(old), identity(cfg)) + inputs_diff(run_dir, inputs)
        world = [line for line in diff if world_change_only([line])]
        float8 = [line for line in diff if line.startswith("float8.")]
        rest = [line for line in diff if line not in world and line not in float8]
        if (world or float8) and not rest and is_completed(run_dir, cfg):
            return Frozen(run_dir, rid, "completed", export_hint(old, cfg, run_dir))  # nothing left to train
        if diff and (not rest or max_steps_only(rest)):  # a raised max_steps, another world and/or float8
            record = {**plan.to_dict(), "inputs": inputs}
            message = extend(old, cfg, record, run_dir) if rest else None
            if world:
                message = change_world(old, cfg, inputs, run_dir, message)
            if float8:
                message = change_float8(old, cfg, record, run_dir, message, refrozen=bool(rest or world))
            return Frozen(run_dir, rid, "resume", message)
        if diff:
            raise ConfigError(
                f"Invalid config: run {rid} in {run_dir} was frozen with a different config; "
                f"refusing to resume it with this one. Differences (frozen -> this command): "
                f"{'; '.join(diff)}. "
                "Use the original overrides to resume, or set run.id=<new id> for a new run."
            )
        if is_completed(run_dir, cfg):
            return Frozen(run_dir, rid, "completed", export_hint(old, cfg, run_dir))
        return Frozen(run_dir, rid, "resume", None if _has_progress(run_dir) else
                      f"Starting run {rid} in {run_dir} (from step 0: no checkpoint yet; another node "
                      "of this run, or an earlier launch, froze it)")
    if cfg.trainer.get("global_batch_size") is None:  # the run's from now on, at any world
        cfg.trainer.global_batch_size = int(plan.global_batch)
    check_elastic_range(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Every node of a multi-node run freezes the same run dir at about the same time: each
        # writes its own temporary files and renames them (same content; the last rename wins).
        # config.yaml goes last: once it exists, the run dir is complete.
        record = {**plan.to_dict(), "inputs": inputs}  # what the named files held (inputs_diff)
        atomic_write_text(RunDir(run_dir).plan, json.dumps(record, indent=2) + "\n")
        atomic_write_text(frozen_path, frozen_yaml(cfg))
    except OSError as e:
        raise ConfigError(
            f"Invalid config: run.root={cfg.run.root!r}: cannot create the run dir {run_dir} ({e.strerror}). "
            "Choose a writable run.root."
        ) from None
    note = continuable_sibling(run_dir, cfg) if auto_id else None
    return Frozen(run_dir, rid, "new", f"Starting run {rid} in {run_dir}\n{note}" if note else None)


def export_hint(old: DictConfig, cfg: DictConfig, run_dir: Path) -> str | None:
    """What a completed run re-run with another `checkpoint.export_format` / `export_dtype` is told
    (volatile keys: the same run, so nothing trains and final/ stays as it was): the `loom export`
    command that writes that export from the run's weights. None when the export is unchanged."""
    was, now = old.get("checkpoint") or {}, cfg.checkpoint
    fmt, dtype = str(now.get("export_format", "loom")), str(now.get("export_dtype", "fp32"))
    old_fmt, old_dtype = str(was.get("export_format", "loom")), str(was.get("export_dtype", "fp32"))
    if (fmt, dtype) == (old_fmt, old_dtype):
        return None
    command = f"loom export {shlex.quote(str(run_dir))} --format {fmt}" + (f" --dtype {dtype}" if dtype != old_dtype else "")
    return (f"Run {run_dir.name} already completed: {run_dir}\nIts final weights were exported with "
            f"checkpoint.export_format={old_fmt} checkpoint.export_dtype={old_dtype}; a completed run does not "
            f"train again to export them another way. Nothing to train. To write this export from the run's "
            f"weights, use:\n  {command}")


def _has_progress(run_dir: Path) -> bool:
    """Whether a frozen run has anything to resume from (a checkpoint) or to report (a summary):
    the second node of a fresh multi-node run finds only the first node's config.yaml."""
    from loom.rundir.checkpoints import complete_checkpoints

    return bool(complete_checkpoints(run_dir)) or RunDir(run_dir).summary.exists()


def continuable_sibling(run_dir: Path, cfg: DictConfig, limit: int = 200) -> str | None:
    """An automatic run id covers trainer.max_steps, so a raised max_steps without run.id is a
    new run: a note naming a run beside it that this command could continue instead."""
    for sibling in RunDir(run_dir).siblings()[:limit]:
        path = sibling.config
        try:
            old, mine = OmegaConf.load(path), copy.deepcopy(cfg)
            mine.trainer.global_batch_size = None
            adopt_run_batch(mine, old, path.parent)
            if max_steps_only(config_diff(identity(old), identity(mine))) and old.trainer.max_steps < cfg.trainer.max_steps:
                return (f"note: run {path.parent.name} has this config with trainer.max_steps="
                        f"{old.trainer.max_steps}; to continue it instead of starting over: run.id={path.parent.name}")
        except Exception:  # a damaged or foreign config.yaml: not a candidate
            continue
    return None


def change_world(old: DictConfig, cfg: DictConfig, inputs: dict[str, str], run_dir: Path,
                 extended: str | None = None) -> str:
    """Refreeze a run resumed at another world size (plan.json, then config.yaml): the layout
    and the global batch were checked by `adopt_run_batch`; plan.json's `world_changes` records
    each change ({at_step, from_world, to_world}); returns the line the launcher prints."""
    from loom.plan import make_plan

    check_elastic_range(cfg)
    step = _resume_step(run_dir)
    before = world_of(old.hardware)
    after = world_of(cfg.hardware)
    rd = RunDir(run_dir)
    old_plan = _read_json(rd.plan)
    changes = list(old_plan.get("world_changes") or [])
    entry = {"at_step": step, "from_world": before, "to_world": after}
    if not changes or changes[-1] != entry:  # not twice (every node of a multi-node run freezes)
        changes.append(entry)
    keep = {k: old_plan[k] for k in ("extended_from_steps", "extended_at_steps") if k in old_plan}
    _refreeze(rd, cfg, {**make_plan(cfg).to_dict(), "inputs": inputs, **keep, "world_changes": changes})
    tr = cfg.trainer
    what = f"World change: {before} -> {after} rank(s)" if before != after else "Layout change"
    line = (f"{what} from step {step}; trainer.accumulate_grad_batches "
            f"{old.trainer.accumulate_grad_batches} -> {tr.accumulate_grad_batches} keeps "
            f"trainer.global_batch_size={tr.global_batch_size}")
    eps = (old.strategy.get("ep", 1), cfg.strategy.get("ep", 1))
    if eps[0] != eps[1]:
        line += f"; strategy.ep {eps[0]} -> {eps[1]} (the experts resharded from the checkpoint)"
    cps = (old.strategy.get("cp", 1), cfg.strategy.get("cp", 1))
    if cps[0] != cps[1]:
        line += f"; strategy.cp {cps[0]} -> {cps[1]} (sequences split over other ranks, states resharded)"
    return f"{extended}\n{line}" if extended else f"Resuming run {cfg.run.id} in {run_dir}\n{line}"


def change_float8(old: DictConfig, cfg: DictConfig, record: dict[str, Any], run_dir: Path,
                  before: str | None, refrozen: bool) -> str:
    """Refreeze a run resumed with other `float8.*` options (plan.json, then config.yaml, unless a
    max_steps or world change already did) and return the line the launcher prints. float8 changes
    how the Linear layers compute, never what a checkpoint holds: torchao's float8 layers keep the
    high-precision `weight` and `bias` under the same names, so the checkpoint loads either way."""
    if not refrozen:
        rd = RunDir(run_dir)
        old_plan = _read_json(rd.plan)
        keep = {k: old_plan[k] for k in ("extended_from_steps", "extended_at_steps", "world_changes")
                if k in old_plan}
        _refreeze(rd, cfg, {**record, **keep})
    step = _resume_step(run_dir)
    names = [str((c.get("float8") or {}).get("name", "none")) for c in (old, cfg)]
    what = f"float8 {names[0]} -> {names[1]}" if names[0] != names[1] else f"float8 {names[1]} options changed"
    how = "trained on in high precision" if names[1] == "none" else "converted at load"
    line = f"{what} from step {step} (the checkpoint's high-precision weights, {how})"
    return f"{before}\n{line}" if before else f"Resuming run {cfg.run.id} in {run_dir}\n{line}"


def _resume_step(run_dir: Path) -> int:
    """The step a resumed run continues from: its newest complete checkpoint's (0 without one)."""
    from loom.rundir.checkpoints import complete_checkpoints, step_of

    ckpts = complete_checkpoints(run_dir)
    return step_of(ckpts[0]) if ckpts else 0


def _refreeze(rd: RunDir, cfg: DictConfig, record: dict[str, Any]) -> None:
    """A resumed run's new plan.json, then its config.yaml: what a world or float8 change rewrites."""
    atomic_write_text(rd.plan, json.dumps(record, indent=2) + "\n")
    atomic_write_text(rd.config, frozen_yaml(cfg))
