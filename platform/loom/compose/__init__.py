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

from omegaconf import DictConfig

from loom.compose import hydra_options, recipes, removal
from loom.compose.groups import GROUP_PACKAGES, valid_keys
from loom.compose.paths import conf_dir, group_options
from loom.errors import ConfigError
from loom.hardware.derive import rederive_for_cpu
from loom.hardware.machine import auto_overrides, user_set
from loom.schema import unknown_key_message

__all__ = ["GROUP_PACKAGES", "compose", "conf_dir", "group_options", "valid_keys"]


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
    removal.apply_removals(cfg, removed)
    user_hw = {o.lstrip("+").partition("=")[0].removeprefix("hardware.") for o in overrides
               if o.lstrip("+").startswith("hardware.")}
    rederive_for_cpu(cfg.hardware, conf_dir() / "hardware", user_hw)
    return cfg


def _concrete(overrides: list[str]) -> list[str]:
    """`hardware=auto` -> this machine's profile; `strategy=single` -> one device by default."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("hardware=")]
    if not chosen or chosen[-1] == "auto":
        overrides = [*auto_overrides(overrides), "++hardware.resolved_from=auto"]
    strategy = [o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")]
    if strategy and strategy[-1] == "single" and not user_set(overrides, "hardware.devices"):
        overrides = [*overrides, "hardware.devices=1"]
    return overrides


def _schema_keys_settable(overrides: list[str]) -> list[str]:
    """`hardware.<key>=v` for every key of the hardware schema, also where the chosen profile's
    YAML leaves the key to the schema's default (hardware=cpu has no min_nodes or timeout_train_s):
    Hydra refuses to set a key its YAML lacks without `+`, and Loom's message then named the key
    among the valid ones. `++` sets it whether the YAML has it or not; unknown keys stay refused."""
    from loom.hardware.schema import HardwareConfig
    from loom.schema import field_names

    fields = set(field_names(HardwareConfig))
    return [f"++{o}" if o.partition("=")[0].removeprefix("hardware.") in fields and o.startswith("hardware.")
            and "=" in o else o for o in overrides]


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
            raise ConfigError(unknown_key_message(key, _override_value(overrides, key),
                                                  valid_keys(key.rpartition(".")[0]))) from None
        raise ConfigError(f"Invalid config: {' '.join(str(e).split())}") from None


def _override_value(overrides: list[str], key: str) -> Any:
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == key:
            return v
    return None
