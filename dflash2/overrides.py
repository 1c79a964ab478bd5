"""YAML config files with `dotted.key=value` command-line overrides (for train and bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_yaml_with_overrides(path: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The mapping in `path` (or {}), with each `a.b.c=value` applied; values are parsed as YAML."""
    import yaml

    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"--config {path}: expected a mapping of config fields")
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
        node[leaf] = yaml.safe_load(value)
    return raw
