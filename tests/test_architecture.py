"""The package layout holds: no import cycles (imports inside functions counted), no module over
400 lines, and every config group answers the same three questions. `lint-imports` (in .ci/run)
checks the layer order; these checks fail with the offending module named."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

from loom.compose import GROUP_PACKAGES, group_options
from loom.schema import GROUPS

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "loom"


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_among_loom_modules():
    graph = grimp.build_graph("loom")
    assert "loom.worker.main" in graph.find_modules_directly_imported_by("loom.launch")  # function-level seen
    assert _cycles(graph) == []


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


@pytest.mark.parametrize("group", GROUPS)
def test_every_config_group_has_schemas_normalize_and_check(group):
    package = GROUP_PACKAGES[group]
    assert callable(package.normalize) and callable(package.check)
    schemas = package.SCHEMAS
    # every option in conf/<group>/ has a schema (auto is resolved to a concrete profile first)
    missing = [o for o in group_options(group) if o not in schemas and "*" not in schemas and o != "auto"]
    assert missing == []


def test_every_document_the_code_cites_exists():
    """A docstring that says "see X.md" points at a file of this repository (docs/architecture.md
    says where things are; a citation of a document the project lacks sends a reader nowhere)."""
    import re

    repo = PACKAGE.parents[1]
    cited = {(str(p.relative_to(repo)), m) for p in [*PACKAGE.rglob("*.py"), *(repo / "scripts").rglob("*.py")]
             for m in re.findall(r"\b(?:docs/[\w-]+|[A-Z][A-Z_]+)\.md\b", p.read_text())}  # not report.md (an output)
    missing = sorted((where, doc) for where, doc in cited if not (repo / doc).is_file())
    assert cited and missing == []


def test_devices_are_multiplied_by_nodes_in_one_place():
    """docs/architecture.md: the profile's world (devices x nodes) has one owner, layout.world_of;
    a second product would drift from it (an elastic range, a resume at another world)."""
    import re

    product = re.compile(r"devices\)?\s*\*\s*[\w(.]*num_nodes|num_nodes\)?\s*\*\s*[\w(.]*devices|nodes \* hw\.devices")
    found = sorted(f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
                   for i, line in enumerate(p.read_text().splitlines(), 1) if product.search(line))
    assert [f.split(":")[0] for f in found] == ["layout.py"], found  # world_of's own line, no other
    from types import SimpleNamespace

    from loom.layout import world_of

    assert world_of(SimpleNamespace(devices=8, num_nodes=4)) == 32
    assert world_of(SimpleNamespace(devices=8, num_nodes=4), nodes=3) == 24


def test_no_if_name_chain_dispatches_on_a_config_option():
    """docs/architecture.md: a group with several behaviours keeps one registry, not `if name ==`
    chains. A function comparing a config option's `.name` with two or more literals is such a
    chain (one guard, `if s.name == "pp"` in a message, is not)."""
    import ast

    chains = []
    for path in PACKAGE.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            literals = set()
            for node in ast.walk(fn):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name"
                        and isinstance(node.comparators[0], ast.Constant | ast.Tuple)):
                    c = node.comparators[0]
                    literals |= {e.value for e in (c.elts if isinstance(c, ast.Tuple) else [c])
                                 if isinstance(e, ast.Constant)}
            if len(literals) >= 2:
                chains.append(f"{path.relative_to(PACKAGE)}:{fn.name} {sorted(literals)}")
    assert chains == [], chains
