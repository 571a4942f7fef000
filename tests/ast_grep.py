"""What the AST greps of the tests share (test_model_families, test_data_options, test_strategy_registry,
test_rundir_names): they let prose name what code may not. Import-light: no torch."""

from __future__ import annotations

import ast


def docstring_ids(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (or bare string statements)."""
    return {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
