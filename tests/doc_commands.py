"""The shell commands printed in the README and the docs, as a user would paste them (used by
tests/test_doc_commands.py): fenced bash blocks line by line (continuations joined, comments dropped,
`&&` chains split) and inline code spans that start with a command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTS = ("python ", "python3 ", "torchrun ", "bash ")
# the interpreter of a vLLM venv, as the docs spell it: replaced by a stand-in file when checked
VLLM_PYTHONS = ("/path/to/vllm-venv/bin/python", "$HOME/vllm-venv/bin/python", "~/vllm-venv/bin/python",
                "/work/vllm-venv/bin/python", "VENV/bin/python")


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "configs").rglob("*.md")),
            *sorted((ROOT / "experiments").rglob("*.md"))]
    return [d for d in docs if d.is_file()]


def commands(text: str) -> list[str]:
    found: list[str] = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            found += _split(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if span.startswith(STARTS):
            found += _split(span)
    return found


def _split(line: str) -> list[str]:
    line = re.sub(r"(^|\s)#(\s.*)?$", "", line.strip()).strip()  # a trailing comment
    return [part.strip() for part in line.split("&&") if part.strip().startswith(STARTS)]


def is_template(command: str) -> bool:
    """A form with placeholders (FILE, DIR, N, [key=value ...], ...), not a command to paste."""
    return bool(re.search(r"\b(FILE|DIR|N|KIND|OUT|PATH)\b|\[[^\]]*\]|\.\.\.|\(as ", command))


def all_commands() -> dict[str, list[str]]:
    """command → the documents that print it (templates left out)."""
    out: dict[str, list[str]] = {}
    for doc in documents():
        for command in commands(doc.read_text()):
            if not is_template(command):
                out.setdefault(command, []).append(str(doc.relative_to(ROOT)))
    return out
