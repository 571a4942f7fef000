"""Recipes: reusable run templates, a Hydra config group (`recipe=NAME`).

A recipe is a yaml file with `# @package _global_`, a header comment (what it is for, what
to override, what it costs) and any keys of the run config, including `defaults:` with
`override /group: option`. The built-in recipes are Loom's bundled `recipes` (`recipes/` of a
checkout, package data of an installed wheel: compose/paths.py); the user's live in every
directory they add with `hydra.searchpath='[file://./my-recipes]'`. They are registered
in Hydra's ConfigStore under the group `recipe` because the directory is named `recipes/`,
not `recipe/` as a search-path group would need.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from loom.compose.paths import bundled
from loom.errors import ConfigError
from loom.schema import GROUPS

SEARCHPATH_KEY = "hydra.searchpath"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path

    @property
    def description(self) -> str:
        """The header's first comment line after `# @package`."""
        for line in self.path.read_text().splitlines():
            text = line.strip()
            if not text.startswith("#"):
                break
            text = text.lstrip("#").strip()
            if text and not text.startswith("@package"):
                return text.split(":", 1)[1].strip() if text.lower().startswith(self.name.lower() + ":") else text
        return ""


def builtin_dir() -> Path:
    """Loom's own recipes (whatever `$LOOM_CONF_DIR` says: that replaces the config groups only)."""
    return bundled("recipes")


def split_searchpath(overrides: list[str]) -> tuple[list[str], list[Path]]:
    """Take `hydra.searchpath=[file://dir,...]` out of the overrides (Loom reads it itself)."""
    rest, dirs = [], []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") != SEARCHPATH_KEY:
            rest.append(o)
            continue
        for item in value.strip().strip("[]").split(","):
            item = item.strip().strip("'\"")
            if not item:
                continue
            if item.startswith("pkg://"):
                raise ConfigError(f"Invalid config: {SEARCHPATH_KEY}={value}: only file:// directories are supported.")
            path = Path(item.removeprefix("file://")).expanduser()
            if not path.is_dir():
                raise ConfigError(
                    f"Invalid config: {SEARCHPATH_KEY}={value}: {path} is not a directory. "
                    "Give directories of recipe yaml files, e.g. hydra.searchpath='[file://./my-recipes]'."
                )
            dirs.append(path.resolve())
    return rest, dirs


def discover(extra_dirs: list[Path] = ()) -> dict[str, Recipe]:
    """Recipes by name; the user's directories come last and win on a name clash."""
    found: dict[str, Recipe] = {}
    for d in [builtin_dir(), *extra_dirs]:
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                found[p.stem] = Recipe(p.stem, p)
    return found


def register(recipes: dict[str, Recipe]) -> None:
    """Put every recipe into Hydra's ConfigStore as an option of the group `recipe`."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    for r in recipes.values():
        cs.store(group="recipe", name=r.name, node=OmegaConf.load(r.path), package="_global_")


def chosen(overrides: list[str], recipes: dict[str, Recipe]) -> str | None:
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")]
    if not names:
        return None
    name = names[-1]
    if name not in recipes:
        raise ConfigError(
            f"Invalid config: recipe={name} is not a known recipe. Valid choices for recipe: "
            f"{', '.join(sorted(recipes)) or '(none)'} (see `loom recipes list`; your own directory "
            "can be added with hydra.searchpath='[file://./my-recipes]')."
        )
    return name


def copy(recipe: Recipe, dest: Path, force: bool) -> Path:
    """A standalone copy the user edits and runs with recipe=<stem> hydra.searchpath=[file://<dir>]."""
    if dest.is_dir():
        dest = dest / recipe.path.name
    if dest.suffix != ".yaml":
        raise ConfigError(f"Invalid destination {dest}: a recipe file must end in .yaml.")
    if dest.exists() and not force:
        raise ConfigError(f"Refusing to overwrite {dest}: it exists. Pass --force to replace it.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(recipe.path, dest)
    return dest


def groups_table() -> str:
    """docs/reference.md's table of config groups: every option of each group (its conf/ files), the
    default (conf/train.yaml's defaults list) and the bundled recipes (tests/test_config.py holds
    that page to it, so an option added or dropped without it fails)."""
    from omegaconf import OmegaConf

    from loom.compose.paths import conf_dir, group_options

    defaults: dict[str, str] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(conf_dir() / "train.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            defaults.update({str(k).replace("optional ", ""): str(v) for k, v in entry.items()})
    rows = ["| group | options | default |", "|---|---|---|"]
    for group in GROUPS:
        rows.append(f"| {group} | {', '.join(group_options(group))} | {defaults.get(group, 'none')} |")
    recipes = sorted(p.stem for p in builtin_dir().glob("*.yaml"))
    rows.append(f"| recipe | {', '.join(recipes)} (recipes/) | none |")
    return "\n".join(rows)
