"""Where tasks come from: lm-eval's own registry, Loom's shipped local tasks (tasks/ beside this
file) and the user's task YAML files or directories (`eval.tasks` entries that are paths).

Torch-free; lm_eval is imported inside the functions (its task index takes seconds to build, so a
config whose tasks are all local indexes only the local directories)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "tasks"


def is_path(entry: str) -> bool:
    """A task entry naming a YAML file or a directory of them, not a registered name."""
    return entry.endswith((".yaml", ".yml")) or "/" in entry or Path(entry).expanduser().is_dir()


def split(entries: list[str]) -> tuple[list[str], list[Path]]:
    """(task names, include paths): a YAML file contributes its folder and its task names, a
    directory itself and every task of it; the shipped tasks are always included."""
    names: list[str] = []
    include: list[Path] = [SHIPPED]
    for entry in entries:
        if not is_path(entry):
            names.append(entry)
            continue
        path = Path(entry).expanduser().resolve()
        folder = path if path.is_dir() else path.parent
        if folder not in include:
            include.append(folder)
        files = sorted(path.glob("*.y*ml")) if path.is_dir() else [path]
        names += [n for f in files for n in yaml_task_names(f)]
    return list(dict.fromkeys(names)), include


def yaml_task_names(path: Path) -> list[str]:
    """The task (or group) names a task YAML registers."""
    import yaml

    class _Tolerant(yaml.SafeLoader):
        pass

    _Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)
    cfg = yaml.load(path.read_text(), Loader=_Tolerant)  # noqa: S506 (a safe loader)
    if not isinstance(cfg, dict):
        return []
    name = cfg.get("task") if isinstance(cfg.get("task"), str) else cfg.get("group")
    return [name] if isinstance(name, str) else []


def task_manager(include: list[Path], *, defaults: bool = True) -> Any:
    """lm-eval's TaskManager over its own tasks (defaults) and the include paths."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in include], include_defaults=defaults)


def manager_for(entries: list[str]) -> tuple[list[str], Any]:
    """(names, TaskManager) for `eval.tasks`: only the local paths when they hold every name."""
    names, include = split(entries)
    local = task_manager(include, defaults=False)
    if all(n in local.all_tasks for n in names):
        return names, local
    return names, task_manager(include)
