"""Optional packages a config option needs, checked at validation (exit 2 in the first second).

pyproject.toml's core dependencies are what `loom train ... tracking=csv` needs; an option that
needs more (wandb for tracking=offline, transformers for model=hf_causal_lm, ...) names the
package and the pip extra that brings it here, so a machine without it (an air-gapped GPU node
installed from a core wheelhouse) refuses the config before compose, plan and freeze are spent,
not when the Trainer is built. `importlib.util.find_spec` finds a package without importing it
(importing wandb alone takes half a second).

One table says which option needs what: each config group hands its rows (`Need`: the option as a
user writes it, when it applies, the import name) as `NEEDS`, `loom.validate.package_needs` joins
them, docs/install.md's table is generated from it, and validation checks every row that applies
before any group normalizes or checks (a missing transformers must not surface as a bad tokenizer
path). Where each package comes from (its pip name and Loom's extra) is `PACKAGES`, pyproject.toml's
extras in one place (tests/test_packages.py holds the two together).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loom.errors import ConfigError

# import name -> (pip name, Loom's extra that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "tracking"),
    "tensorboard": ("tensorboard", "tracking"),
    "mlflow": ("mlflow-skinny", "tracking"),
    "matplotlib": ("matplotlib", "tracking"),
    "transformers": ("transformers", "hf"),
    "datasets": ("datasets", "hf"),
    "peft": ("peft", "hf"),
    "sklearn": ("scikit-learn", "data"),
    "optuna": ("hydra-optuna-sweeper", "sweeps"),
    "kubeflow_trainer_api": ("kubeflow-trainer-api", "kubernetes"),
    "lm_eval": ("lm-eval", "eval"),
    "torchao": ("torchao", "float8"),
}


VALIDATION, TRAINING = "validation", "training"  # when a row is checked: by every verb, or by `loom train`


@dataclass(frozen=True)
class Need:
    """A row of the table: `option` (as a user turns it on) runs code that imports `module`."""

    option: str                            # "model.lora.r > 0", "dataset=hf", "tracking=offline"
    applies: Callable[[Any], bool]         # on the typed (not yet normalized) config
    module: str                            # a key of PACKAGES
    example: tuple[str, ...] = ()          # overrides that turn it on (the table's test composes them)
    instead: str | None = None             # what to use without the package, when there is something
    # VALIDATION: validating (any verb) needs it; TRAINING: only what `loom train` starts does (a
    # tracker, a launcher: `loom plan tracking=offline` plans without wandb)
    checked: str = VALIDATION
    says: Callable[[Any], str] | None = None  # the option as this config turned it on (default: `option`)

    def check(self, cfg: Any) -> None:
        if self.applies(cfg):
            pip_name, extra = PACKAGES[self.module]
            require(self.module, option=self.says(cfg) if self.says else self.option, extra=extra,
                    pip_name=pip_name, instead=self.instead)


def check_needs(cfg: Any, needs: tuple[Need, ...], checked: str) -> None:
    """Every row of `needs` checked at `checked` that applies to `cfg` (ConfigError: the first missing)."""
    for need in needs:
        if need.checked == checked:
            need.check(cfg)


def installed(module: str) -> bool:
    """Whether `module` (a top-level import name) can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, *, option: str, extra: str, pip_name: str | None = None,
            instead: str | None = None) -> None:
    """Raise ConfigError when `option` (e.g. "tracking=offline") needs `module` and it is missing."""
    if installed(module):
        return
    hint = f"; or use {instead}" if instead else ""
    raise ConfigError(
        f"Invalid config: {option} needs the Python package {pip_name or module}, which is not "
        f"installed for this interpreter. Install it with `pip install 'loom[{extra}]'` (offline: "
        f"scripts/wheelhouse.sh DIR --with {extra}, then scripts/setup.sh --offline DIR){hint}."
    )
