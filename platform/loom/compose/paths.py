"""Where Loom's bundled files live: the config groups, the built-in recipes, the SLURM template.

One owner for the question because the answer depends on how Loom was installed. A wheel
(`pip install .`, or a wheel on a cluster image) carries them as package data inside the package
(`loom/_conf`, `loom/_recipes`, `loom/_slurm`: setup.py maps the checkout's folders there). A
checkout, and an editable install of it, keeps them where a developer edits them: `conf/`,
`recipes/` and `scripts/slurm/` at the repository root.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

# bundle name -> its folder in the checkout (setup.py ships each as the package `loom._<name>`)
CHECKOUT_FOLDERS = {"conf": "conf", "recipes": "recipes", "slurm": "scripts/slurm"}


def bundled(name: str) -> Path:
    """The folder of one bundle: the installed package's data, else the checkout's folder."""
    packaged = files("loom") / f"_{name}"
    if packaged.is_dir():  # a wheel install: files on disk inside site-packages
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[3] / CHECKOUT_FOLDERS[name]
    if not checkout.is_dir():
        raise FileNotFoundError(
            f"Loom's bundled {name!r} files are missing: neither {packaged} (an installed wheel) nor "
            f"{checkout} (a checkout). Reinstall Loom (`pip install .` from the repository)."
        )
    return checkout


def conf_dir() -> Path:
    """The primary config directory: `$LOOM_CONF_DIR`, else Loom's bundled `conf`."""
    env = os.environ.get("LOOM_CONF_DIR")
    return Path(env) if env else bundled("conf")


def group_options(group: str) -> list[str]:
    """The yaml files of one config group, i.e. the valid `group=option` choices."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
