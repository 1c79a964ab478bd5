"""YAML config files with `dotted.key=value` command-line overrides (for train and bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_yaml_with_overrides(path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The mapping in `path` (or {}), with each `a.b.c=value` applied; values are parsed as YAML.

    Every malformed input is a ValueError (FileNotFoundError for a missing file) whose message names the
    file with the line and column of a YAML syntax error, or the override, so the CLIs print one line."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        raw = _parse(path.read_text(), f"--config {path}") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--config {path}: expected a mapping of config fields, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form dotted.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part} is not a section")
        node[leaf] = _parse(value, f"override {item!r}")
    return raw


def _parse(text: str, where: str) -> Any:
    """YAML `text` → its value; a syntax error → ValueError "where: line L, column C: problem"."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        within = ""
        if err.context and err.context_mark is not None:
            within = f" ({err.context} started at line {err.context_mark.line + 1}, column {err.context_mark.column + 1})"
        raise ValueError(f"{where}: not valid YAML: {at}{err.problem or err.context}{within}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML: {err}") from None
