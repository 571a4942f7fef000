"""Where Loom's bundled files live: the config groups, the built-in recipes, the SLURM template.

One owner for the question because the answer depends on how Loom was installed. A wheel
(`pip install .`, or a wheel on a cluster image) carries them as package data inside the package
(`loom/_conf`, `loom/_recipes`, `loom/_slurm`: setup.py maps the checkout's folders there). A
checkout, and an editable install of it, keeps them where a developer edits them: `conf/`,
`recipes/` and `scripts/slurm/` at the repository root.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# bundle name -> its folder in the checkout (setup.py ships each as the package `loom._<name>`)
CHECKOUT_FOLDERS = {"conf": "conf", "recipes": "recipes", "slurm": "scripts/slurm"}


def bundled(name: str) -> Path:
    """The folder of one bundle: the installed package's data, else the checkout's folder."""
    packaged = files("loom") / f"_{name}"
    if packaged.is_dir():  # a wheel install: files on disk inside site-packages
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / CHECKOUT_FOLDERS[name]
    if not checkout.is_dir():
        raise FileNotFoundError(
            f"Loom's bundled {name!r} files are missing: neither {packaged} (an installed wheel) nor "
            f"{checkout} (a checkout). Reinstall Loom (`pip install .` from the repository)."
        )
    return checkout


def shipped_path(path: str) -> Path:
    """`path` as given (user-expanded), else, when it names a file of Loom's bundled conf as the
    README writes them (`conf/deepspeed/zero2.json`) and no such file is here, the shipped copy:
    an installed Loom has no `conf/` in the working directory."""
    p = Path(path).expanduser()
    if not p.exists() and p.parts[:1] == ("conf",):
        shipped = bundled("conf").joinpath(*p.parts[1:])
        if shipped.exists():
            return shipped
    return p
