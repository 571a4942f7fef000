"""Optional packages a config option needs, checked at validation (exit 2 in the first second).

pyproject.toml's core dependencies are what `loom train ... tracking=csv` needs; an option that
needs more (wandb for tracking=offline, transformers for model=hf_causal_lm, ...) names the
package and the pip extra that brings it here, so a machine without it (an air-gapped GPU node
installed from a core wheelhouse) refuses the config before compose, plan and freeze are spent,
not when the Trainer is built. `importlib.util.find_spec` finds a package without importing it
(importing wandb alone takes half a second).
"""

from __future__ import annotations

import importlib.util

from loom.errors import ConfigError


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
