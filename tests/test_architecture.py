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


ARCHITECTURE = PACKAGE.parents[1] / "docs" / "architecture.md"


def test_every_module_the_architecture_page_names_exists():
    """docs/architecture.md names modules by path (`strategies/expert_parallel.py`, or a bare
    `fit.py` in its folder's row): each is a file of the package, so a module moved or renamed
    without the page fails here."""
    import re

    files = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")]
    named = {t for t in re.findall(r"`([\w/]+\.py)`", ARCHITECTURE.read_text())}
    missing = sorted(t for t in named if not any(f == t or f.endswith("/" + t) for f in files)
                     and not (PACKAGE.parents[1] / t).is_file())  # tests/..., scripts/...
    assert len(named) > 50 and missing == [], missing


def test_the_functions_the_architecture_page_names_exist():
    """`module.name` on the page (`layout.world_of`, `construct._left_for_loom`, `optim.OPTIMIZERS`,
    `hardware.hang_timeout_s`) is defined, imported or declared as a schema field in that module, or
    in a file of that package; a name moved elsewhere or gone fails here."""
    import re

    scopes: dict[str, list[Path]] = {}
    for p in PACKAGE.rglob("*.py"):  # a module: its file; a package: every file in its folder
        scopes.setdefault(p.stem, []).append(p)
    for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if (p / "__init__.py").is_file())]:
        scopes.setdefault(d.name, []).extend(d.rglob("*.py"))
    refs = {(m, n) for m, n in re.findall(r"`([a-z_]+)\.([A-Za-z_]\w*)`", ARCHITECTURE.read_text())
            if m in scopes and n not in ("py", "json", "build_peak_rss_gb_per_rank")}  # a summary.json key
    defined = r"^\s*(?:def|class)\s+{0}\b|^\s*{0}\s*[:=]|^\s*(?:from\s+\S+\s+)?import\s.*\b{0}\b"
    missing = sorted(f"{m}.{n}" for m, n in refs
                     if not (m == "loom" and ((PACKAGE / n).is_dir() or (PACKAGE / f"{n}.py").is_file()))
                     and not any(re.search(defined.format(n), p.read_text(), re.M) for p in scopes[m]))
    assert len(refs) > 20 and missing == [], missing


def test_the_architecture_page_states_the_layers_lint_imports_holds():
    """The page's layer line (`cli > generate > ... > errors | atomic | ...`) is pyproject.toml's
    import-linter layers contract, in order, with the same modules in each layer."""
    import re

    import tomllib

    project = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    layers = next(c["layers"] for c in project["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    contract = [sorted(re.split(r"\s*[|:]\s*", layer.replace("loom.", ""))) for layer in layers]
    text = " ".join(ARCHITECTURE.read_text().split())
    line = re.search(r"`(cli > [^`]+)`", text).group(1)
    page = [sorted(["hardware", "strategies", "data", "models", "optim", "tracking", "eval", "objectives",
                   "float8"]) if part == "config groups"
            else sorted(re.split(r"\s*\|\s*", part)) for part in (p.strip() for p in line.split(">"))]
    assert page == contract


def test_the_folder_map_has_every_top_level_module():
    """Each module and package directly under platform/loom/ has a row in the page's folder map."""
    import re

    text = ARCHITECTURE.read_text()
    table = text.split("## Folder map")[1].split("\n\n")[1]
    named = set(re.findall(r"`([\w]+)(?:\.py|/)`", table))
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert sorted(top - named) == []
