"""Each dataset option lives in one module or folder (platform/loom/data/options/<name>) and the rest
of Loom asks its `DatasetOption` (loom.data.option) instead of recognizing it: no module outside an
option's folder (the registry's one line aside) names the option or reads one of its own config
keys. Docstrings and comments may talk about options; code may not.

An option's own keys are those of its schema that no other option's schema has (`paths`,
`text_column`, `mix`, `empty_replies`, `kind`...); a key several options have (`seq_len`, `path`,
`tokenizer`) is shared, read by what lies below them. Option names are matched as whole string
constants where code tells options apart (compared with a dataset's name, a key of DATASETS), and
anywhere when the name is no ordinary word of the code ("tokens" counts summaries, "hf" is an export
format): substrings never count.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import tomllib
from ast_grep import docstring_ids

from loom.data.option import DatasetOption
from loom.data.registry import DATASETS, OPTIONS
from loom.schema import field_names

ROOT = Path(__file__).resolve().parents[1] / "platform" / "loom"
OPTIONS_DIR = ROOT / "data" / "options"
REGISTRY = ROOT / "data" / "registry.py"
WORDS = {"tokens", "hf"}  # option names that are also ordinary words of the code
DATASET_NAMES = {"ds", "dataset", "DATASETS"}  # a dataset config, or the registry, by name


def _keys(option: DatasetOption) -> set[str]:
    return set(field_names(option.schema))


def _own_keys() -> dict[str, set[str]]:
    """Each option's keys that no other option has."""
    out = {}
    for option in OPTIONS:
        others = set().union(*(_keys(o) for o in OPTIONS if o is not option))
        out[option.name] = _keys(option) - others
    return out


OWN_KEYS = _own_keys()


def _folder(name: str) -> Path:
    """An option's folder, or its module."""
    return OPTIONS_DIR / name if (OPTIONS_DIR / name).is_dir() else OPTIONS_DIR / f"{name}.py"




def _is_dataset(node: ast.AST) -> bool:
    """A dataset config (`ds`, `dataset`, `cfg.dataset`) or the registry itself."""
    return ((isinstance(node, ast.Name) and node.id in DATASET_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in {"dataset", "DATASETS"}))


def _is_dataset_name(node: ast.AST) -> bool:
    """A dataset config's name: `ds.name`, `cfg.dataset.name`, `ds.get("name")`, `ds["name"]`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "name" and _is_dataset(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return _is_dataset(node.func.value) and bool(node.args) and _constants(node.args[0]) == ["name"]
    return isinstance(node, ast.Subscript) and _is_dataset(node.value) and _constants(node.slice) == ["name"]


def _constants(node: ast.AST) -> list[str]:
    """The string constants a comparison operand or a key is: one, or a tuple/list/set of them."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _key_read(node: ast.AST, keys: set[str]) -> str | None:
    """The option key a node reads off a dataset config: `ds.key`, `ds.get("key")`, `ds["key"]`,
    `"key" in ds`."""
    if isinstance(node, ast.Attribute) and node.attr in keys and _is_dataset(node.value):
        return f".{node.attr}"
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"get", "pop"}
            and _is_dataset(node.func.value) and node.args and set(_constants(node.args[0])) & keys):
        return f".{node.func.attr}({_constants(node.args[0])[0]!r})"
    if isinstance(node, ast.Subscript) and _is_dataset(node.value) and set(_constants(node.slice)) & keys:
        return f"[{_constants(node.slice)[0]!r}]"
    if (isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            and set(_constants(node.left)) & keys and any(_is_dataset(c) for c in node.comparators)):
        return f"{_constants(node.left)[0]!r} in"
    return None


def _names_option(node: ast.AST, names: set[str], docs: set[int]) -> str | None:
    """The option a node names: a constant compared with a dataset's name or looked up in DATASETS
    (`DATASETS["hf"]`, `DATASETS.get("hf")`), or (a name that is no ordinary word) any string constant."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        said = {c for o in operands for c in _constants(o)} & names
        if said and any(_is_dataset_name(o) for o in operands):
            return sorted(said)[0]
    registry = isinstance(node, ast.Subscript | ast.Call) and any(
        isinstance(n, ast.Name | ast.Attribute) and "DATASETS" in {getattr(n, "id", None), getattr(n, "attr", None)}
        for n in ast.walk(node.value if isinstance(node, ast.Subscript) else node.func))
    said = (_constants(node.slice) if isinstance(node, ast.Subscript)
            else [c for a in node.args for c in _constants(a)] if isinstance(node, ast.Call) else [])
    if registry and set(said) & names:
        return sorted(set(said) & names)[0]
    if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            and node.value in names - WORDS):
        return node.value
    return None


def offences(source: str, names: set[str] | None = None, keys: set[str] | None = None) -> list[str]:
    """What a module's code (not its docstrings and comments) says about the options `names`
    (default: all) and their own `keys`."""
    names = set(DATASETS) if names is None else names
    keys = set().union(*OWN_KEYS.values()) if keys is None else keys
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (read := _key_read(node, keys)) is not None:
            found.append(f"{line}: reads {read}")
        if (name := _names_option(node, names, docs)) is not None:
            found.append(f"{line}: names {name!r}")
        if (imported := _imports_option(node, names)) is not None:
            found.append(f"{line}: imports {imported}")
    return found


def _imports_option(node: ast.AST, names: set[str]) -> str | None:
    """The option module an import names (`from loom.data.options.chat.build import ...`,
    `from loom.data.options import chat`)."""
    prefix = "loom.data.options"
    if isinstance(node, ast.ImportFrom) and node.module == prefix:
        return next((f"{prefix}.{a.name}" for a in node.names if a.name in names), None)
    modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
               else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
    for module in modules:
        parts = module.split(".")
        if module.startswith(prefix + ".") and parts[3] in names:
            return module
    return None


def _owner(path: Path) -> str | None:
    """The option whose folder or module holds `path`."""
    return next((name for name in DATASETS if path == _folder(name) or path.is_relative_to(_folder(name))), None)


def test_no_module_outside_an_option_folder_names_it_or_reads_its_keys():
    report = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == REGISTRY:
            continue
        own = _owner(path)
        names = set(DATASETS) - {own}
        keys = set().union(*(k for name, k in OWN_KEYS.items() if name != own))
        bad = offences(path.read_text(), names, keys)
        if bad:
            report[str(path.relative_to(ROOT))] = bad
    assert not report, "\n".join(f"{f}: {'; '.join(b)}" for f, b in report.items())


@pytest.mark.parametrize("code, caught", [
    ('if ds.name == "chat": pass', True),
    ('if cfg.dataset.name in ("tinycode", "text_files"): pass', True),
    ('if cfg.dataset.name != "hf": pass', True),
    ('if "tokens" == ds.name: pass', True),
    ('option = DATASETS["hf"]', True),
    ('option = registry.DATASETS.get("tokens")', True),
    ('if ds.get("name") == "hf": pass', True),
    ('if spec.kind == "tokens": pass', False),
    ('NAME = "text_files"', True),
    ("replies = cfg.dataset.get('empty_replies')", True),
    ("paths = ds.paths", True),
    ('if "vocab_size" in ds: pass', True),
    ("column = cfg.dataset['text_column']", True),
    ("from loom.data.options.chat.build import stores", True),
    ("from loom.data.options import digits", True),
    ("import loom.data.options.synthetic.sets", True),
    ("from loom.data.option import DatasetOption", False),
    ('n = stats["tokens"]', False),
    ('if fmt == "hf": pass', False),
    ('export = export_request(run, "hf", None)', False),
    ("n = ds.seq_len + cfg.dataset.batch_size", False),
    ('tok = ds.get("tokenizer")', False),
    ("kind = store.kind", False),
    ('def f():\n    """dataset=chat reads ds.chat_template; tinycode is the default."""\n    return 1', False),
    ('x = 1  # "text_files" in a comment', False),
])
def test_the_grep_catches_names_and_keys_but_not_words_or_prose(code, caught):
    assert bool(offences(code)) is caught


def test_every_yaml_is_an_option_and_every_option_has_its_folder():
    conf = ROOT.parents[1] / "conf" / "dataset"
    assert sorted(DATASETS) == sorted(p.stem for p in conf.glob("*.yaml"))
    assert len(DATASETS) == len(OPTIONS)  # no two options share a name
    for name, option in DATASETS.items():
        folder = _folder(name)
        assert folder.exists(), f"dataset={name}: no {folder.relative_to(ROOT)}"
        module = importlib.import_module(f"loom.data.options.{name}")
        assert module.OPTION is option, f"dataset={name}: the registry's entry is not its module's OPTION"
        target, _, fn = option.datasets.partition(":")
        assert fn and target.startswith(f"loom.data.options.{name}"), \
            f"dataset={name}: its datasets {option.datasets!r} lies outside its folder"


def test_the_layers_contract_places_every_data_module():
    """A new module of loom.data takes a layer (above or below the options), so an arrow back up fails."""
    config = tomllib.loads((ROOT.parents[1] / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c.get("containers") == ["loom.data"])
    placed = {m.strip() for layer in contract["layers"] for m in layer.replace("|", ":").split(":")}
    modules = {p.stem if p.is_file() else p.name for p in (ROOT / "data").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert modules <= placed, f"not in the loom.data layers contract: {sorted(modules - placed)}"


def test_nothing_in_data_imports_a_module_by_name():
    """A module found by a string hides its arrow from the import graph (the circle through
    data/hf.py did): data/ imports statically; only an option's `datasets` target is loaded by
    name (loom.schema.load), and it lies in the option's folder (above)."""
    found = []
    for path in sorted((ROOT / "data").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in {"import_module", "__import__"}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
