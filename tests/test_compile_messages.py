"""A first compiled call says that it compiles, and how long it took, on a terminal (a pty here), and
nothing off one (issue: StaticTarget(compile=True)'s first call looked like a hang)."""

from __future__ import annotations

import copy
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


def test_the_drafters_warm_up_is_announced_once(monkeypatch, capsys):
    """A compiled drafter compiles its round's graphs in a warm-up before its first round (the logic
    is checked here without inductor: compile_own returns the round as it is)."""
    import torch

    import dflash2.drafter.rounds as drafter_module
    from dflash2 import DFlash2Drafter, TargetAdapter, TorchRandom
    from tests.helpers import tiny_target

    monkeypatch.setattr(drafter_module, "compile_own", lambda method, **kwargs: method)
    target = copy.deepcopy(tiny_target("qwen3")).float()  # (the cached model is shared: .float() is in place)
    for terminal in (True, False):
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
        drafter = DFlash2Drafter.from_target(target, block_size=4, num_layers=1, mask_token_id=0).float()
        drafter.compile(dynamic=True)
        adapter, cache = TargetAdapter(target, drafter.target_layer_ids), drafter.new_cache()
        features = torch.randn(1, 3, len(drafter.target_layer_ids) * target.config.hidden_size)
        with torch.no_grad():
            for n in (3, 1):
                drafter.propose(cache, 1, features[:, :n], adapter, 0.0, TorchRandom(torch.Generator()))
        assert drafter.warmed == {False} and cache.length == 4  # the warm-up's scratch rounds left it alone
        err = capsys.readouterr().err.splitlines()
        if terminal:
            assert len(err) == 2 and err[0].startswith("compiling the drafter's round (torch.compile") \
                and re.fullmatch(r"compiled the drafter's round in \d+ s", err[1]), err
        else:
            assert err == []
