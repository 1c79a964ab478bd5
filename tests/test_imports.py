"""No import circles: no module of dflash2 needs another that needs it back, counting every import,
those inside functions too; the configuration sits at the bottom and the core never imports its users."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash2"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The dflash2 modules `path` imports (relative imports resolved; `from . import x` → the module x)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for name in candidates:
            if name.startswith("dflash2") and _exists(name):
                found.add(name)
    return found


def _exists(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_bench_modules_import_no_circle():
    files = sorted((PACKAGE / "bench").glob("*.py"))
    names = {module_name(f) for f in files}
    graph = {module_name(f): {m for m in imports(f, top_level_only=False) if m in names and m != "dflash2.bench"}
             for f in files if f.name not in ("__init__.py", "__main__.py")}
    assert len(graph) >= 8 and graph["dflash2.bench.run"]  # the walk sees the package
    assert not cycles(graph), cycles(graph)


def package_graph() -> dict[str, set[str]]:
    """Every dflash2 module → the dflash2 modules it imports anywhere (function-level imports too). A
    package's __init__ importing its own modules is how packages are built, not an arrow back up."""
    files = [f for f in PACKAGE.rglob("*.py") if "embedded/" not in str(f.relative_to(PACKAGE)) or f.parent.name == "embedded"]
    graph = {module_name(f): {m for m in imports(f, top_level_only=False) if m != module_name(f)} for f in files}
    packages = {module_name(f) for f in files if f.name == "__init__.py"}
    return {m: {n for n in deps if not (m in packages and n.startswith(m + "."))} for m, deps in graph.items()}


def test_no_module_of_the_package_imports_itself_back_anywhere():
    graph = package_graph()
    assert len(graph) > 40 and "dflash2.registry" in graph["dflash2.config"]  # the walk sees function-level imports
    assert not cycles(graph), cycles(graph)


def test_the_config_is_a_leaf_and_the_core_never_imports_its_users():
    graph = package_graph()
    assert graph["dflash2.config"] <= {"dflash2.registry"}  # names are checked against the registry, a leaf itself
    core = ("dflash2.decoding", "dflash2.drafter", "dflash2.targets", "dflash2.policy", "dflash2.interfaces")
    users = ("dflash2.bench", "dflash2.train", "dflash2.engines", "dflash2.generate")
    upward = sorted((m, n) for m, deps in graph.items() if m.startswith(core) for n in deps if n.startswith(users))
    assert not upward, upward
    # the loops decide nothing about widths: they never import a policy
    assert not [(m, n) for m, deps in graph.items() if m.startswith("dflash2.decoding") for n in deps
                if n.startswith("dflash2.policy")]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
