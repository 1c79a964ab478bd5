"""The house reads top-down: no module over 450 lines, no class over 250, no docstring over 15 lines.
(Import circles: tests/test_imports.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash2"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_DOCSTRING_LINES = 450, 250, 15


def oversized(source: str) -> list[str]:
    """Every rule `source` breaks, one line each."""
    tree = ast.parse(source)
    found = []
    if len(source.splitlines()) > MAX_MODULE_LINES:
        found.append(f"module: {len(source.splitlines())} lines")
    for node in ast.walk(tree):
        name = getattr(node, "name", "<module>")
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
            found.append(f"class {name}: {node.end_lineno - node.lineno + 1} lines")
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.strip("\n").splitlines()) > MAX_DOCSTRING_LINES:
                found.append(f"{name}: docstring of {len(doc.strip().splitlines())} lines")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_sizes(path):
    assert oversized(path.read_text()) == []


def test_the_check_catches_each_rule():
    doc = '"""' + "\n".join(["line"] * 16) + '"""'
    body = "\n".join(f"    x{i} = {i}" for i in range(251))
    assert oversized(f"{doc}\n") == ["<module>: docstring of 16 lines"]
    assert oversized(f"class C:\n{body}\n") == ["class C: 252 lines"]
    assert oversized(f"def f():\n    {doc}\n") == ["f: docstring of 16 lines"]
    assert oversized("x = 1\n" * 451) == ["module: 451 lines"]
    assert oversized("def f():\n    '''Short.'''\n") == []
