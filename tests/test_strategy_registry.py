"""The strategy registry owns every fact about a strategy option: an option added to it (and its
conf/strategy yaml) is weighed by `loom plan --compare` with no list elsewhere to edit, and no
module outside `loom/strategies/` names an option (the grep below, as tests/test_model_families.py)."""

from __future__ import annotations

import ast
import dataclasses
import shutil
from pathlib import Path

import pytest
from ast_grep import docstring_ids

from loom.compose import compose, group_options
from loom.plan.compare import compare
from loom.strategies import registry
from loom.strategies.registry import STRATEGIES

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "loom"
NAMES = {*STRATEGIES, registry.AUTO}
# Option names that are also other words of the code base: "pp" the pipeline degree (strategy.pp,
# layout.parallel()["pp"]), "auto" another key's value (hardware=auto, optim, loader workers, matplotlib).
# Such a constant counts as a strategy name only beside "strategy" in a comparison, or in a collection
# with another option's name.
HOMONYMS = {"pp", "auto"}
# Uses not yet moved to a registry field, each with its reason (path under loom/, name).
ALLOWED = {
    # models/ may not import strategies/ (sibling packages of one layer): the refusal's hint for a tied
    # head under pp names the preset whose degrees cannot be set to pp=1 alone.
    ("models/checks.py", "pp"),
}




def _names_in(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in NAMES}


def strategy_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each string constant of `source` naming a strategy option (docstrings and
    comments are prose: allowed)."""
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    counted: dict[int, tuple[int, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and "strategy" in ast.unparse(node):
            for n in ast.walk(node):
                if isinstance(n, ast.Constant) and n.value in NAMES:
                    counted[id(n)] = (n.lineno, n.value)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) and len(_names_in(node) - HOMONYMS) > 0:
            for n in ast.walk(node):
                if isinstance(n, ast.Constant) and n.value in NAMES:
                    counted[id(n)] = (n.lineno, n.value)
        elif (isinstance(node, ast.Constant) and node.value in NAMES - HOMONYMS and id(node) not in docs):
            counted[id(node)] = (node.lineno, node.value)
    return sorted(counted.values())


def test_no_module_outside_strategies_names_a_strategy():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("strategies/"):
            continue
        found += [f"{rel}:{line}: {name!r}" for line, name in strategy_names(path.read_text())
                  if (rel, name) not in ALLOWED]
    assert not found, "ask loom.strategies.registry for a field instead:\n" + "\n".join(found)


@pytest.mark.parametrize("code, caught", [
    ('ORDER = ("single", "ddp", "pp")', ["ddp", "pp", "single"]),
    ('if cfg.strategy.name == "pp": pass', ["pp"]),
    ('if name == "zero3_offload": pass', ["zero3_offload"]),
    ('if composed.strategy.get("name") == "auto": pass', ["auto"]),
    ('x = layout.parallel()["pp"]; hw = chosen == "auto"', []),
    ('def f():\n    """strategy=ddp is the default."""\n    return 1  # fsdp too', []),
])
def test_the_grep_catches_names_but_not_homonyms_or_prose(code, caught):
    assert sorted(name for _, name in strategy_names(code)) == caught


def test_every_strategy_yaml_is_a_registry_option_and_ranks_are_distinct():
    assert set(group_options("strategy")) == {*STRATEGIES, registry.AUTO}
    ranks = [option.rank for option in STRATEGIES.values()]
    assert len(set(ranks)) == len(ranks)
    assert set(registry.cheapest_first()) <= set(STRATEGIES) and registry.async_checkpoint_options()


@pytest.fixture
def ddp_copy(tmp_path, monkeypatch):
    """A new option `ddp_copy`: its conf/strategy yaml and one registry entry (a copy of ddp's),
    ranked before every other option so that it comes first where layouts tie."""
    conf = tmp_path / "conf"
    shutil.copytree(PACKAGE.parents[1] / "conf", conf)
    text = (conf / "strategy" / "ddp.yaml").read_text().replace("name: ddp", "name: ddp_copy")
    (conf / "strategy" / "ddp_copy.yaml").write_text(text)
    monkeypatch.setenv("LOOM_CONF_DIR", str(conf))
    monkeypatch.setitem(STRATEGIES, "ddp_copy", dataclasses.replace(STRATEGIES["ddp"], rank=-1))
    return "ddp_copy"


def test_an_option_added_to_the_registry_is_weighed_by_plan_compare(ddp_copy):
    result = compare(compose(["hardware=cpu", "hardware.devices=2", "hardware.cpu_cores=2", "model=gpt_tiny",
                              "dataset.batch_size=4", "dataset.seq_len=128"]))
    names = [c.strategy for c in result.candidates]
    assert ddp_copy in names and "ddp" in names
    mine, ddp = (next(c for c in result.candidates if c.strategy == s) for s in (ddp_copy, "ddp"))
    assert mine.predicted_step_s == ddp.predicted_step_s  # the same option under another name
    assert names.index(ddp_copy) < names.index("ddp")  # its rank breaks the tie
    assert mine.overrides == [f"strategy={ddp_copy}"]
