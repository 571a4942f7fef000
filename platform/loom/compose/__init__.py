"""Stage 1, compose: Hydra composes conf/train.yaml + a recipe + the user's overrides.

Composition also makes the choices the overrides leave open concrete, as overrides that the
frozen config then shows: `hardware=auto` becomes this machine's profile (with
`hardware.resolved_from=auto`), and `strategy=single` gets one device unless the user said
otherwise. Hydra's errors become one-paragraph ConfigErrors naming the key and the choices.
Hydra's own options (`hydra.*`) are done or refused (`hydra_options`), `~key` removes what the
schema lets go (`removal`), and `loom train --help`/`--info` describe the groups (`help`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.compose import hydra_options, recipes, removal
from loom.compose.groups import GROUP_PACKAGES, open_dicts, valid_keys
from loom.compose.paths import conf_dir, group_options
from loom.errors import ConfigError
from loom.hardware.derive import rederive_for_cpu
from loom.hardware.machine import auto_overrides, user_set
from loom.schema import unknown_key_message
from loom.strategies.registry import STRATEGIES

__all__ = ["GROUP_PACKAGES", "compose", "conf_dir", "group_options", "valid_keys"]


def _if_lora(on: Any, off: Any, *, _root_: DictConfig) -> Any:
    """`${loom.if_lora:ON,OFF}`: ON when the run trains LoRA adapters (model.lora.r > 0), else OFF
    (recipes/sft.yaml's learning rate: 2e-4 for adapters, 2e-5 for a full fine-tune)."""
    return on if (OmegaConf.select(_root_, "model.lora.r", default=0) or 0) > 0 else off


OmegaConf.register_new_resolver("loom.if_lora", _if_lora, replace=True)


def compose(overrides: list[str]) -> DictConfig:
    """The composed (not yet validated) config of one run: Hydra's own options done or refused
    (`hydra_options`), `~key` given the schema's meaning (`removal`), a GPU profile run on
    `hardware.accelerator=cpu` re-derived (`loom.hardware.derive`)."""
    overrides = hydra_options.translate(list(overrides))
    overrides, recipe_dirs = recipes.split_searchpath(overrides)
    overrides, removed = removal.split_removals(overrides)
    found = recipes.discover(recipe_dirs)
    if recipes.chosen(overrides, found):
        recipes.register(found)
    cfg = hydra_compose(_schema_keys_settable(_concrete(overrides)))
    _refuse_allow_list_from_files(cfg, overrides, [found[n].path for n in [recipes.chosen(overrides, found)] if n],
                                  recipe_dirs)
    removal.apply_removals(cfg, removed)
    user_hw = {o.lstrip("+").partition("=")[0].removeprefix("hardware.") for o in overrides
               if o.lstrip("+").startswith("hardware.")}
    rederive_for_cpu(cfg.hardware, conf_dir() / "hardware", user_hw)
    return cfg


def _refuse_allow_list_from_files(cfg: DictConfig, overrides: list[str], recipe_files: list,
                                  recipe_dirs: list) -> None:
    """`security.allow_targets` widens what `_target_` may import: only the user's command line
    may set it (conf/train.yaml's own value aside). A recipe, a group file or anything found
    through hydra.searchpath that sets it is refused, naming the file: a shared template must not
    run code its user never allowed. The command line's value replaces any file's (Hydra applies
    overrides last), so only a run without one can carry a file's."""
    from omegaconf import OmegaConf

    if any(o.lstrip("+").partition("=")[0] in ("security", "security.allow_targets") for o in overrides):
        return
    primary = OmegaConf.load(conf_dir() / "train.yaml").get("security", {}).get("allow_targets", [])
    got = OmegaConf.to_container(cfg.security, resolve=False).get("allow_targets") if "security" in cfg else []
    if list(got or []) == list(primary or []):
        return
    from loom.compose.help import chosen

    candidates = [*recipe_files, *(conf_dir() / g / f"{o}.yaml" for g, o in chosen(overrides).items()),
                  *(f for d in recipe_dirs for f in sorted(d.glob("*.yaml")))]
    try:  # an interpolated value, as it would apply
        got = OmegaConf.to_container(cfg.security, resolve=True).get("allow_targets") or got
    except Exception:
        pass
    shown = got if isinstance(got, list) else [got]
    culprit = next((f for f in candidates if f.is_file() and any(
        "allow_targets" in line.split("#", 1)[0] for line in f.read_text().splitlines())), None)
    raise ConfigError(
        f"Invalid config: security.allow_targets={shown} is set by {culprit or 'a config file'}, but extra "
        "`_target_` prefixes may only come from the command line (a recipe or config file must not widen "
        "what code a run may import). Remove it from the file; if you trust that code, allow it yourself: "
        f"security.allow_targets='[{','.join(map(str, shown))}]'."
    )


def _concrete(overrides: list[str]) -> list[str]:
    """`hardware=auto` -> this machine's profile; `strategy=single` (an option with the registry's
    `one_device`) -> one device by default."""
    strategy = [o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")]
    option = STRATEGIES.get(strategy[-1]) if strategy else None
    one_device = bool(option and option.one_device)
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hardware=")]
    if not chosen or chosen[-1] == "auto":  # hardware=auto
        overrides = [*auto_overrides(overrides, one_device), "++hardware.resolved_from=auto"]
    if one_device and not user_set(overrides, "hardware.devices"):
        overrides = [*overrides, "hardware.devices=1"]
    return overrides


def _schema_keys_settable(overrides: list[str]) -> list[str]:
    """`hardware.<key>=v` (`tracking.<key>=v`) for every key of the hardware (tracking) schema, also
    where the chosen option's YAML leaves the key to the schema's default (hardware=cpu has no
    min_nodes or timeout_train_s; no tracking YAML restates the straggler rule's numbers): Hydra
    refuses to set a key its YAML lacks without `+`, and Loom's message then named the key among
    the valid ones. `++` sets it whether the YAML has it or not; unknown keys stay refused."""
    from loom.hardware.schema import HardwareConfig
    from loom.schema import field_names
    from loom.tracking.schema import TrackingConfig

    fields = {group: set(field_names(schema)) for group, schema in (("hardware", HardwareConfig),
                                                                    ("tracking", TrackingConfig))}

    def settable(o: str) -> bool:
        group, _, key = o.partition("=")[0].partition(".")
        return "=" in o and key in fields.get(group, ())

    return [_into_open_dict(f"++{o}" if settable(o) else o) for o in overrides]


def _into_open_dict(override: str) -> str:
    """`model.overrides={k: v}`, `model.overrides.k=v` and `+model.overrides.k=v` alike set the key
    (`++`): a field typed `dict[str, Any]` (`groups.open_dicts`) takes any key, which Hydra's struct
    mode refuses where the YAML has none (`overrides: {}`), naming no valid key. A `++` merge of a
    dict is what Hydra's plain `key={...}` does. The option's check names the keys it accepts."""
    key, eq, _ = override.partition("=")
    bare = key.lstrip("+")
    if eq and not key.startswith(("~", "++")) and any(bare == d or bare.startswith(d + ".") for d in open_dicts()):
        return f"++{bare}{override[len(key):]}"
    return override


def hydra_compose(overrides: list[str]) -> DictConfig:
    """Hydra-compose conf/train.yaml with the overrides; Hydra errors -> ConfigError."""
    from hydra import compose as compose_api
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="loom"):
            return compose_api("train", overrides=list(overrides))
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
            from loom.models import key_notes
            from loom.strategies.checks import key_notes as strategy_notes

            raise ConfigError(unknown_key_message(key, _override_value(overrides, key),
                                                  valid_keys(key.rpartition(".")[0]),
                                                  {**key_notes(), **strategy_notes()})) from None
        raise ConfigError(f"Invalid config: {' '.join(str(e).split())}") from None


def _override_value(overrides: list[str], key: str) -> Any:
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == key:
            return v
    return None
