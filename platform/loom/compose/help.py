"""`loom train --help` and `--info`: what Hydra's own `--help` and `--info` show, for Loom.

--help: the flags, then "== Configuration groups ==" (every directory of conf/ and the recipes,
with their options, read from the files: no composition, no torch), the config's sections and
Hydra's options Loom supports. --info: the config search path and the sources of each group.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from loom.compose import hydra_options, recipes
from loom.compose.paths import conf_dir, group_options


def groups() -> list[str]:
    """The config groups: the directories of conf/ holding yaml files."""
    return sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def defaults() -> dict[str, str]:
    """The default option of each group, from conf/train.yaml's defaults list."""
    out: dict[str, str] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(conf_dir() / "train.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                out[str(key).removeprefix("optional ")] = "(none)" if value is None else str(value)
    return out


def chosen(overrides: list[str]) -> dict[str, str]:
    """Each group's option under `overrides` (the last `group=option` wins), else its default."""
    out = defaults()
    for o in overrides:
        key, eq, value = o.lstrip("+").partition("=")
        if eq and key in out:
            out[key] = value
    return out


def _recipes(overrides: list[str]) -> tuple[list[Path], dict[str, recipes.Recipe]]:
    _, dirs = recipes.split_searchpath([o for o in overrides if o.lstrip("+").startswith(recipes.SEARCHPATH_KEY)])
    return dirs, recipes.discover(dirs)


def train_help(flags: str, overrides: list[str]) -> str:
    """Hydra's `--help` layout: the flags, the groups with their options, the config, Hydra's options."""
    default = defaults()
    lines = [flags.rstrip(), "", "== Configuration groups ==",
             "Compose your configuration from those groups (group=option); * marks the default", ""]
    for group in groups():
        opts = [f"{o}*" if o == default.get(group) else o for o in group_options(group)]
        lines.append(f"{group}: {', '.join(opts)}")
    _, found = _recipes(overrides)
    lines += [f"recipe: {', '.join(found) or '(none)'}  (optional; `loom recipes list` says what each is for)",
              "", "== Config ==",
              "Override anything in the config (key=value), add a key the schema allows (+key=value),",
              "remove an optional key (~key, e.g. ~trainer.gradient_clip_val). Sections: experiment, seed,",
              "run, trainer, checkpoint, security, sweep, and the groups above. `loom train --cfg job [overrides]`",
              "prints the composed config; `loom plan [overrides]` what the run will cost.",
              "", "== Hydra options ==", f"Supported: {hydra_options.SUPPORTED}.",
              "Any other hydra.* override is refused (exit 2) naming the Loom key to use."]
    return "\n".join(lines)


def info_text(overrides: list[str]) -> str:
    """Hydra's `--info` essentials: the search path, each group's source, the chosen options."""
    import hydra

    dirs, found = _recipes(overrides)
    conf = conf_dir()
    lines = [f"Hydra {hydra.__version__} (compose API; Loom runs the job)", "",
             "== Config search path ==",
             f"main     file://{conf}  (train.yaml and the config groups; $LOOM_CONF_DIR overrides it)",
             f"recipes  file://{recipes.builtin_dir()}  (group recipe, built in)"]
    lines += [f"user     file://{d}  (hydra.searchpath)" for d in dirs]
    lines += ["", "== Config sources ==", f"primary  {conf / 'train.yaml'}"]
    for group in groups():
        lines.append(f"{group:<8} {conf / group}/  ({len(group_options(group))} options)")
    for r in found.values():
        lines.append(f"recipe   {r.path}  (recipe={r.name})")
    lines += ["", "== Defaults (this command) =="]
    lines += [f"{group}: {option}" for group, option in chosen(overrides).items()]
    return "\n".join(lines)
