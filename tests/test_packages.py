"""Optional packages (loom.packages, issue 50): one table says which option needs which package,
every row is refused with exit 2 before anything starts when its package is missing (named with
Loom's extra), docs/install.md's table is the registry's, and each package is in the extra it names.

In-process, no launch: the CLI's own `main` with this interpreter made blind to the row's package
(a meta-path finder that raises ModuleNotFoundError for it, as an install without it would)."""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import FAST, ROOT, refused
from packaging.requirements import Requirement

from loom.packages import PACKAGES, TRAINING, VALIDATION
from loom.validate import needs_table, package_needs

ROWS = package_needs()
BASE = (*(o for o in FAST if not o.startswith("dataset.")), "trainer.max_steps=2")


class _Without(importlib.abc.MetaPathFinder):
    """This interpreter as if `module` were not installed."""

    def __init__(self, module: str) -> None:
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module or name.startswith(self.module + "."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def _without(monkeypatch, module: str) -> None:
    monkeypatch.setattr(sys, "meta_path", [_Without(module), *sys.meta_path])
    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)


def _plan(root: Path, *args: str) -> tuple[int, str]:
    from loom import cli

    err = io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["plan", *args, f"run.root={root}"])
    return rc, err.getvalue()


def test_every_row_names_a_package_of_the_extra_it_names():
    """PACKAGES' (pip name, extra) pairs are pyproject.toml's extras; every row has an example."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {Requirement(r).name for r in reqs} for extra, reqs in extras.items()}
    for module, (pip_name, extra) in PACKAGES.items():
        assert pip_name in names[extra], (module, pip_name, extra, names[extra])
    assert {n.module for n in ROWS} <= set(PACKAGES)
    assert all(n.example and n.checked in (VALIDATION, TRAINING) for n in ROWS)
    # the rows: LoRA -> peft, a tokenizer -> transformers; every tracker; the Kubernetes launcher
    assert {("model.lora.r > 0", "peft"), ("dataset.tokenizer=<name or directory>", "transformers")} <= {
        (n.option, n.module) for n in ROWS}
    assert {"wandb", "tensorboard", "mlflow", "kubeflow_trainer_api", "datasets", "sklearn", "optuna"} <= {
        n.module for n in ROWS}


@pytest.mark.parametrize("need", ROWS, ids=[f"{n.option}->{n.module}" for n in ROWS])
def test_each_row_is_refused_without_its_package(tmp_path, monkeypatch, need):
    """`loom train` with the row's example refuses in one paragraph (exit 2, nothing written) naming
    the option, the package and `loom[<extra>]`; a row validation needs refuses `loom plan` too, a row
    only training needs lets `loom plan` through."""
    pip_name, extra = PACKAGES[need.module]
    _without(monkeypatch, need.module)
    err = refused(tmp_path, *BASE, *need.example)
    assert f"needs the Python package {pip_name}, which is not installed" in err, err
    assert f"loom[{extra}]" in err and "\n" not in err.strip(), err
    rc, plan_err = _plan(tmp_path, *BASE, *need.example)
    if need.checked == VALIDATION:
        assert rc == 2 and f"needs the Python package {pip_name}" in plan_err, plan_err
    else:
        assert "needs the Python package" not in plan_err, plan_err


def test_lora_without_peft_is_refused_naming_it(tmp_path, monkeypatch):
    """The issue's case: model.lora.r=8 without peft launched and died in the ranks with 'Cannot copy
    out of meta tensor'; now refused naming the option, peft and loom[hf]."""
    _without(monkeypatch, "peft")
    err = refused(tmp_path, *BASE, "model=llama_tiny", "model.lora.r=8")
    assert err.strip().startswith("Invalid config: model.lora.r > 0 needs the Python package peft"), err
    assert "pip install 'loom[hf]'" in err


def test_the_docs_table_is_the_registrys():
    readme = (ROOT / "docs" / "install.md").read_text()
    table = readme.split("<!-- optional-packages:begin -->\n")[1].split("\n<!-- optional-packages:end -->")[0]
    assert table == needs_table(), "regenerate it: python -c 'import loom.validate as v; print(v.needs_table())'"


def test_an_optuna_sweep_without_optuna_is_refused_before_its_first_trial(tmp_path, monkeypatch):
    _without(monkeypatch, "optuna")
    err = refused(tmp_path, "-m", *BASE, "sweep.sampler=optuna", "optim.lr=interval(0.001,0.01)")
    assert "sweep.sampler=optuna (hydra/sweeper=optuna) needs the Python package hydra-optuna-sweeper" in err, err
