"""A first compiled call says that it compiles, and how long it took, on a terminal (a pty here), and
nothing off one (issue: StaticTarget(compile=True)'s first call looked like a hang)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HAS_CXX_COMPILER

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch
from dflash2 import StaticTarget, ar_generate
from tests.helpers import tiny_target
model = tiny_target("qwen3").float()
fast = StaticTarget(model, (), compile=True)
ar_generate(fast, torch.tensor([[3, 7, 1]]), max_new_tokens=3)
ar_generate(fast, torch.tensor([[3, 7, 1]]), max_new_tokens=3)
print("done")
"""


def on_a_terminal() -> str:
    """What SCRIPT writes to stderr when stderr is a terminal (a pty)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=follower,
                            env=dict(os.environ, TERM="dumb"))
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the pty closes when the process ends
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=600) == 0
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_the_first_compiled_call_is_announced_on_a_terminal_only():
    seen = on_a_terminal()
    starts = re.findall(r"compiling the target's StaticTarget step \(torch.compile: .*\)\.\.\.", seen)
    ends = re.findall(r"compiled the target's StaticTarget step in (\d+) s", seen)
    assert len(starts) == 1 and len(ends) == 1, seen  # once: the second decode compiles nothing
    assert seen.index(starts[0]) < seen.index("compiled the target")
    assert "compiled" not in seen.split("compiled the target")[1]  # and the second decode compiles nothing


def test_the_drafters_first_compiled_round_is_announced(monkeypatch, capsys):
    import torch

    from dflash2.layers import announced_first_call

    calls = []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    fn = announced_first_call(lambda x: calls.append(x) or x, "the drafter's round")
    assert fn(torch.ones(1)) is not None and fn(2) == 2 and len(calls) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("compiling the drafter's round (torch.compile") and re.fullmatch(
        r"compiled the drafter's round in \d+ s", err[1]) and len(err) == 2
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # off a terminal: silent
    fn = announced_first_call(lambda x: x, "the drafter's round")
    assert fn(3) == 3 and capsys.readouterr().err == ""
