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
