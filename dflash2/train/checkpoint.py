"""Atomic training checkpoints: a run killed at any moment resumes from the last complete one.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then renamed
over the old one (`os.replace` is atomic on POSIX), so a reader only ever sees a whole checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(file) on a temporary file beside `path`, flush it to disk, rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def save_checkpoint(path: str | Path, state: dict[str, Any], config: dict[str, Any] | None = None) -> None:
    """torch.save `state` atomically to `path` (streamed to the file: no second copy in memory); the
    resolved `config` goes beside it as JSON."""
    path = Path(path)
    if config is not None:  # the config first: a checkpoint never lacks its config
        atomic_write_bytes(path.with_suffix(".config.json"), (json.dumps(config, indent=2) + "\n").encode())
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The saved state, or None when there is no checkpoint yet."""
    path = Path(path)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
