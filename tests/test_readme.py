"""The README's first Python block runs as written and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_python_block() -> str:
    text = (ROOT / "README.md").read_text()
    use_it = text[text.index("## Use it"):]
    return re.search(r"```python\n(.*?)```", use_it, flags=re.S).group(1)


def test_the_first_python_block_runs_and_drafts():
    code = first_python_block()
    assert "load_embedded" in code and "path/to" not in code  # the runnable one, not the placeholder one
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    tau, speedup = map(float, re.match(r"tau (\d+\.\d+), (\d+\.\d+)x plain decoding\n", out.stdout).groups())
    assert tau > 3  # the speed depends on the machine's load; τ does not
    assert speedup > 0


def test_what_is_where_names_every_module():
    """The README's "What is where" names every module of the flat core and every subpackage."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What is where"):text.index("## Compatibility")]
    package = ROOT / "dflash2"
    names = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    names += [p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    missing = [n for n in names if n not in section]
    assert not missing, missing
