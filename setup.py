"""Which files the `loom` package ships (the rest of the project's metadata is in pyproject.toml).

The Python packages come from platform/; Loom's bundled files stay where a developer edits them
(conf/, recipes/, scripts/slurm/ at the repository root) and ship inside the package as
`loom._conf`, `loom._recipes` and `loom._slurm`, read at run time through importlib.resources
(platform/loom/compose/paths.py). pyproject.toml alone cannot say this: its package finder and a
package-dir mapping of folders outside platform/ do not combine. An editable install keeps
reading the checkout's folders. loom/eval/tasks/ (lm-eval task YAML and JSONL, no __init__.py) ships as
loom.eval's package data.
"""

from pathlib import Path

from setuptools import find_packages, setup

BUNDLED = {"loom._conf": "conf", "loom._recipes": "recipes", "loom._slurm": "scripts/slurm"}


def data_packages() -> dict[str, str]:
    """Each bundled folder and its subfolders as a package name -> its folder in the checkout."""
    found = {}
    for package, folder in BUNDLED.items():
        for d in [Path(folder), *sorted(p for p in Path(folder).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            found[".".join([package, *d.relative_to(folder).parts])] = d.as_posix()
    return found


DATA = data_packages()
setup(packages=[*find_packages("platform"), *DATA], package_dir={"": "platform", **DATA},
      package_data={**{package: ["*"] for package in DATA}, "loom.eval": ["tasks/*"]})  # the shipped eval tasks
