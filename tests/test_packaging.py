"""Loom as a package (issue 35): a wheel carries the config groups, the recipes and the SLURM
template, and an install of it works from any directory without the checkout; an editable install
keeps reading the checkout's folders.

The wheel is built from a copy of the sources (a build writes build/ and *.egg-info beside them)
and installed, without its dependencies, into a fresh venv that reaches this venv's packages
through a plain path in a .pth file: not this checkout's editable Loom, which that venv must not
see. No training runs: `loom train --cfg job`, `loom plan` and a SLURM `--dry-run` exercise
composition, planning, freezing and the template.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BUNDLED = {"conf": "loom/_conf", "recipes": "loom/_recipes", "scripts/slurm": "loom/_slurm"}
pytestmark = pytest.mark.slow


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """What a build reads, copied: the metadata, platform/ and the bundled folders."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(REPO / name, src / name)
    for name in ("platform", "conf", "recipes", "scripts"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def _venv(where: Path) -> tuple[Path, Path]:
    """A venv that sees this venv's packages (torch, hydra, ...) but no Loom: (python, site-packages)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = subprocess.run([str(where / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "see_loom_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin/python", Path(purelib)


def _pip(python: Path, *args: str, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    r = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "--no-input", *args], cwd=cwd,
                       env={**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _run(exe: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_CONF_DIR", "LOOM_SLURM_TEMPLATE", "PYTHONPATH")}
    return subprocess.run([str(exe), *args], cwd=cwd, env={**env, "COLUMNS": "300"}, capture_output=True, text=True)


def test_wheel_ships_the_bundled_files_and_runs_from_another_directory(source: Path, tmp_path: Path):
    _pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source),
         cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("loom-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, packaged in BUNDLED.items():  # every file of each bundled folder, under the package
        assert {f"{packaged}/{f}" for f in _files(source / folder)} <= names, folder
    assert {f"loom/{f}" for f in _files(source / "platform/loom")} <= names  # every module

    python, purelib = _venv(tmp_path / "venv")
    _pip(python, "install", "--no-deps", "--ignore-installed", str(wheel), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    site = subprocess.run([str(python), "-c", "import loom.compose.paths as p; print(p.conf_dir()); "
                           "print(p.bundled('recipes')); print(p.bundled('slurm'))"],
                          cwd=elsewhere, capture_output=True, text=True, check=True).stdout.split()
    assert site == [str(purelib / f"loom/_{name}") for name in ("conf", "recipes", "slurm")]

    loom = tmp_path / "venv/bin/loom"
    listed = _run(loom, "recipes", "list", cwd=elsewhere)
    assert listed.returncode == 0, listed.stderr
    assert all(p.stem in listed.stdout for p in (source / "recipes").glob("*.yaml"))
    job = _run(loom, "train", "--cfg", "job", cwd=elsewhere)
    assert job.returncode == 0, job.stderr
    cfg = yaml.safe_load(job.stdout)
    assert (cfg["experiment"], cfg["model"]["name"], cfg["strategy"]["name"]) == ("gpt", "gpt_tiny", "ddp")  # experiment: the family
    plan = _run(loom, "plan", cwd=elsewhere)
    assert plan.returncode == 0 and "fits" in plan.stdout, plan.stdout + plan.stderr
    # the README's `strategy.deepspeed_config=conf/deepspeed/zero2.json`: no conf/ here, the shipped copy
    ds = _run(loom, "train", "--cfg", "job", "strategy=zero2", "strategy.deepspeed_config=conf/deepspeed/zero2.json",
              cwd=elsewhere)
    assert ds.returncode == 0, ds.stderr
    assert yaml.safe_load(ds.stdout)["strategy"]["deepspeed_config"] == str(purelib / "loom/_conf/deepspeed/zero2.json")
    slurm = _run(loom, "train", "--dry-run", "hardware=slurm", "hardware.accelerator=cpu", "run.id=s", cwd=elsewhere)
    assert slurm.returncode == 0, slurm.stdout + slurm.stderr
    rendered = (elsewhere / "runs/gpt/s/slurm/job.sbatch").read_text()
    assert rendered.startswith("#!/bin/bash\n# Loom SLURM job: run s (gpt)") and "{{" not in rendered


def test_editable_install_reads_the_checkout_folders(source: Path, tmp_path: Path):
    """`pip install -e .` (setuptools' import finder, as setup.py maps folders outside platform/):
    Loom imports from the checkout and reads conf/, recipes/ and scripts/slurm/ there, where a
    developer edits them."""
    python, _ = _venv(tmp_path / "venv")
    _pip(python, "install", "--no-deps", "--no-build-isolation", "--ignore-installed", "-e", str(source), cwd=tmp_path)
    where = subprocess.run([str(python), "-c", "import loom, loom.compose.paths as p; print(loom.__file__); "
                            "print(p.conf_dir()); print(p.bundled('recipes')); print(p.bundled('slurm'))"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(source / "platform/loom/__init__.py"), str(source / "conf"), str(source / "recipes"),
                     str(source / "scripts/slurm")]
