"""The air-gapped install (issue 27): scripts/wheelhouse.sh collects the wheels, and
scripts/setup.sh --offline DIR --system-torch installs Loom from them with no index into a venv
that sees a site's torch, which then trains.

The "site" is built here the way a GPU image looks: an interpreter whose packages are only the
PyTorch stack (torch, numpy, Lightning and what they require), linked from this venv, so every
other package must come from the wheelhouse. Building the wheelhouse reads the package index
(as scripts/setup.sh does); `.ci/run` builds it once, before the tests, and names it in
LOOM_WHEELHOUSE, so the suite itself installs with `--no-index` only.

The resolution runs against the torch the site serves, under the site's pip constraints (issue 35):
checked offline on small made-up packages with pip's real resolver, and, when this file builds the
wheelhouse itself, with a PIP_CONSTRAINT that pins torch to this interpreter's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from launches import LEDGER
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
SITE_ROOTS = ("torch", "numpy", "pytorch-lightning")
TORCH = metadata.version("torch")  # the wheelhouse's default target: this interpreter's torch
pytestmark = pytest.mark.slow


def _requires(dist: metadata.Distribution, extras: frozenset[str]) -> list[Requirement]:
    """What `dist` requires, with the extras it was asked for (Lightning's fsspec[http])."""
    env_extras = {"", *extras}
    return [req for req in map(Requirement, dist.requires or [])
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in env_extras)]


def site_stack() -> list[metadata.Distribution]:
    """The installed distributions a PyTorch image would hold: SITE_ROOTS and what they require."""
    seen: dict[tuple[str, frozenset[str]], metadata.Distribution] = {}
    todo = [(name, frozenset()) for name in SITE_ROOTS]
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        try:
            dist = metadata.distribution(key[0])
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        todo += [(req.name, frozenset(req.extras)) for req in _requires(dist, extras)]
    return list({canonicalize_name(d.metadata["Name"]): d for d in seen.values()}.values())


def link_site(dest: Path) -> None:
    """Symlink the stack's top-level modules and metadata (no copies: torch is ~1 GB)."""
    dest.mkdir(parents=True)
    for dist in site_stack():
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            src = base / top
            if src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    given = os.environ.get("LOOM_WHEELHOUSE")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheelhouse")
    pin = out.parent / "site-constraints.txt"  # a site pinning torch, as pip.conf's `constraint` does
    pin.write_text(f"torch=={TORCH.split('+')[0]}\n")
    subprocess.run([str(REPO / "scripts/wheelhouse.sh"), str(out)], check=True, cwd=REPO,
                   env={**os.environ, "PYTHON": sys.executable, "PIP_CONSTRAINT": str(pin)})
    return out


def test_wheelhouse_core_set_is_complete_and_small(wheelhouse: Path):
    manifest = json.loads((wheelhouse / "manifest.json").read_text())
    names = {w["name"] for w in manifest["wheels"]}
    # The packages a GPU image lacks, two of them built here from sdists.
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "deepspeed", "pydantic", "hjson"} <= names
    assert not names & {"torch", "numpy", "pytorch-lightning", "triton"}
    for w in manifest["wheels"]:
        assert (wheelhouse / w["file"]).stat().st_size == w["bytes"]
    assert manifest["bytes_by_group"]["core"] < 10 * 2**20
    assert manifest["torch"] == TORCH  # resolved for the torch it serves
    assert not list(wheelhouse.glob("torch-*.whl"))  # the stub is the resolution's, never shipped


def _wheel(where: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A metadata-only wheel: all pip's resolver reads."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(where / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{info}/RECORD", "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"]))


@pytest.fixture
def wheelhouse_py(monkeypatch, tmp_path):
    """scripts/wheelhouse.py as a module, its pip isolated from this machine's configuration and
    index, with a site constraint of the kind a fresh machine carries (torch<=2.14.1)."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONSTRAINT", str(constraints))
    spec = importlib.util.spec_from_file_location("wheelhouse_under_test", REPO / "scripts/wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resolution_runs_against_the_target_torch_under_a_pip_constraint(wheelhouse_py, tmp_path):
    """pip's own resolver, offline, on made-up packages: the target's torch passes the site's
    constraint, pip takes the release that supports it, and one that needs a newer torch is named
    in one paragraph (package, requirement, target) instead of being packed."""
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "plain", "1.0", ("torch>=2.6",))
    _wheel(links, "falls-back", "2.0", ("torch>=2.99",))  # its newest release needs a newer torch
    _wheel(links, "falls-back", "1.0", ("torch>=2.6",))
    _wheel(links, "needs-new", "1.0", ("torch>=2.99",))
    target = ["--python-version", "3.11", "--platform", "manylinux2014_x86_64"]
    report = wheelhouse_py.resolve(sys.executable, links, ["plain", "falls-back"], target, TORCH)
    assert {i["metadata"]["name"]: i["metadata"]["version"] for i in report} == \
        {"torch": TORCH, "plain": "1.0", "falls-back": "1.0"}
    with pytest.raises(wheelhouse_py.WheelhouseError) as needs:
        wheelhouse_py.resolve(sys.executable, links, ["plain", "needs-new"], target, TORCH)
    assert str(needs.value).startswith(f"needs-new 1.0 requires torch>=2.99: no release that fits torch {TORCH},")
    assert "\n" not in str(needs.value)
    # The stub the wheelhouse used to resolve against (torch 9999): the site's constraint refuses it.
    with pytest.raises(wheelhouse_py.WheelhouseError) as excluded:
        wheelhouse_py.resolve(sys.executable, links, ["plain"], target, "9999")
    assert str(excluded.value).startswith("pip's constraints (torch<=2.14.1; from PIP_CONSTRAINT")
    assert "exclude torch 9999, the torch this wheelhouse is built for" in str(excluded.value)


@pytest.mark.parametrize("torch, says", [
    ("2.5.0", "torch 2.5.0 is outside Loom's supported range (torch>=2.6, pyproject.toml)"),
    ("two", "--torch two is not a version"),
])
def test_wheelhouse_refuses_a_target_torch_loom_does_not_support(tmp_path, torch, says):
    """Before any download or build: exit 2, one line naming the version, no traceback."""
    out = tmp_path / "wh"
    r = subprocess.run([str(REPO / "scripts/wheelhouse.sh"), str(out), "--torch", torch], cwd=REPO,
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith(f"wheelhouse: {says}")
    assert r.stderr.count("\n") == 1 and not out.exists()


@pytest.mark.launch
def test_offline_venv_over_site_torch_trains(wheelhouse: Path, tmp_path: Path):
    site, base, venv = tmp_path / "site-packages", tmp_path / "base", tmp_path / "venv"
    link_site(site)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(base)], check=True)
    purelib = subprocess.run([str(base / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "site_torch.pth").write_text(f"{site}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHON=str(base / "bin/python"), LOOM_VENV=str(venv), PIP_NO_INDEX="1", PIP_FIND_LINKS="",
               PIP_CONFIG_FILE=os.devnull)
    setup = subprocess.run([str(REPO / "scripts/setup.sh"), "--offline", str(wheelhouse), "--system-torch"],
                           cwd=REPO, env=env, capture_output=True, text=True)
    assert setup.returncode == 0, setup.stderr[-3000:]
    # hydra came from the wheelhouse, torch from the site (not copied into the venv).
    where = subprocess.run([str(venv / "bin/python"), "-c", "import hydra, torch; print(hydra.__file__); print(torch.__file__)"],
                           capture_output=True, text=True, env=env)
    hydra_file, torch_file = where.stdout.split()
    assert hydra_file.startswith(str(venv)) and torch_file.startswith(str(site))
    args = ("train", "strategy=single", "trainer.max_steps=2", "tracking=csv", f"run.root={tmp_path / 'runs'}", "experiment=offline", "run.id=r")
    t0 = time.perf_counter()
    run = subprocess.run([str(venv / "bin/loom"), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    LEDGER.record(1, time.perf_counter() - t0, args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((tmp_path / "runs/offline/r/summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2


def test_system_torch_missing_is_refused(wheelhouse: Path, tmp_path: Path):
    """An interpreter without torch: refused before any venv work, naming the interpreter."""
    base = tmp_path / "bare"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(base)], check=True)
    env = {**os.environ, "PYTHON": str(base / "bin/python"), "LOOM_VENV": str(tmp_path / "venv")}
    r = subprocess.run([str(REPO / "scripts/setup.sh"), "--offline", str(wheelhouse), "--system-torch"],
                       cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert "cannot import torch" in r.stderr and str(base / "bin/python") in r.stderr
    assert not (tmp_path / "venv").exists()
