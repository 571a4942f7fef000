"""Each model family lives in one folder (platform/loom/models/<family>/) and the rest of Loom asks
its `ModelFamily` (loom.models.family) instead of recognizing it: no module outside a family's
folder names a family or an architecture, one of its module classes, or reads one of its config
keys. Docstrings and comments may talk about them; code may not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from ast_grep import docstring_ids

from loom.models.registry import FAMILIES, MODELS

ROOT = Path(__file__).resolve().parents[1] / "platform" / "loom"
FAMILY_DIRS = ("models/gpt", "models/llama", "models/moe", "models/hf")
REGISTRY = "models/registry.py"  # the one line per family
# names of families and architectures (nanoGPT's flat token files are a data format, not a model)
FAMILY_WORDS = re.compile(r"(?<!nano)gpt|llama|mistral|mixtral|qwen|gemma|phi-?3|olmo|deepseek", re.IGNORECASE)
MODULE_CLASSES = {"Block", "DecoderLayer", "CausalSelfAttention", "LlamaDecoderLayer", "GPT", "Llama"}
# config keys a family owns (reading them elsewhere is sniffing the family from its keys)
FAMILY_KEYS = {"n_head", "n_kv_heads", "n_layer", "d_model", "intermediate_size", "tie_embeddings", "qkv_bias",
               "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "tie_word_embeddings",
               "rope_theta", "rope_scaling"}
SIZES = {"vocab_size", "block_size"}  # a dataset has them too: only `cfg.model.vocab_size` is the model's




def offences(source: str) -> list[str]:
    """What a module's code (not its docstrings and comments) says about a family."""
    tree = ast.parse(source)
    docs = docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if FAMILY_WORDS.search(node.value) or node.value in MODULE_CLASSES | FAMILY_KEYS:
                found.append(f"{line}: string {node.value[:60]!r}")
        elif isinstance(node, ast.Attribute) and (node.attr in FAMILY_KEYS or FAMILY_WORDS.search(node.attr)):
            found.append(f"{line}: .{node.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr in SIZES and isinstance(node.value, ast.Attribute)
              and node.value.attr == "model"):
            found.append(f"{line}: model.{node.attr}")
        elif isinstance(node, ast.Name) and (node.id in MODULE_CLASSES or FAMILY_WORDS.search(node.id)):
            found.append(f"{line}: name {node.id}")
        elif isinstance(node, ast.ImportFrom) and node.module and FAMILY_WORDS.search(node.module):
            found.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.alias) and FAMILY_WORDS.search(node.name):
            found.append(f"{line}: import {node.name}")
    return found


def _outside_families() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(p.is_relative_to(ROOT / d) for d in FAMILY_DIRS) and p != ROOT / REGISTRY)


def test_no_module_outside_a_family_folder_names_a_family_or_sniffs_its_keys():
    report = {str(p.relative_to(ROOT)): bad for p in _outside_families() if (bad := offences(p.read_text()))}
    assert not report, "\n".join(f"{f}: {'; '.join(b)}" for f, b in report.items())


@pytest.mark.parametrize("code, caught", [
    ('is_gpt = "n_head" in model', True),
    ("heads = cfg.model.n_kv_heads", True),
    ("from loom.models.llama.network import DecoderLayer", True),
    ("units = (Block,)", True),
    ("vocab = int(cfg.model.vocab_size)", True),
    ("vocab = cfg.dataset.vocab_size", False),
    ('path = "tokens.bin"  # a nanoGPT file', False),
    ('def f():\n    """Llama\'s n_head, in words."""\n    return 1', False),
])
def test_the_grep_catches_names_keys_and_classes_but_not_prose(code, caught):
    assert bool(offences(code)) is caught


def test_every_option_has_a_family_folder_or_is_a_plain_option_and_a_yaml():
    conf = ROOT.parents[1] / "conf" / "model"
    assert sorted(MODELS) == sorted(p.stem for p in conf.glob("*.yaml"))
    for family in FAMILIES:
        module, _, fn = family.build.partition(":")
        folder = ROOT.parent / Path(*module.split("."))
        assert fn and (folder.with_suffix(".py").is_file() or folder.is_dir()), family.build
        assert family.summary, family.name


def test_the_docs_model_table_is_the_registrys():
    from loom.models import family_table

    readme = (ROOT.parents[1] / "docs" / "models.md").read_text()
    table = readme.split("<!-- model-families:begin -->\n")[1].split("\n<!-- model-families:end -->")[0]
    assert table == family_table(), "regenerate it: python -c 'import loom.models as m; print(m.family_table())'"
