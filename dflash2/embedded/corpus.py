"""The corpus of the embedded demo pair: the Python standard library's own source.

Every Python install carries it, so the pair can be rebuilt anywhere without a download. Files are
the `.py` files under `sysconfig.get_paths()["stdlib"]`, excluding `site-packages` and the test
suites (`test/`, `tests/`, `idlelib/idle_test/`, `lib2to3/tests/`: huge, repetitive fixture code).
The split is by top-level module: a module goes to held-out when the first byte of the SHA-256 of
its name is < 13 (about 5%), so the split is stable across machines and Python patch releases.

    python -m dflash2.embedded.corpus      # prints the split's sizes and the held-out modules
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELDOUT_THRESHOLD = 13  # of 256


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_of(path: Path, root: Path) -> str:
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_heldout(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] < HELDOUT_THRESHOLD


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted .py files of split "train" or "heldout"."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        if EXCLUDED_PARTS & set(path.relative_to(root).parts):
            continue
        if is_heldout(module_of(path, root)) == (split == "heldout"):
            files.append(path)
    return files


def read_texts(split: str) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(split)]


if __name__ == "__main__":
    root = stdlib_root()
    for split in ("train", "heldout"):
        files = corpus_files(split)
        size = sum(p.stat().st_size for p in files)
        print(f"{split}: {len(files)} files, {size / 1e6:.2f} MB")
    print("held-out modules:", sorted({module_of(p, root) for p in corpus_files("heldout")}))
