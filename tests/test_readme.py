"""The README's runnable Python block runs as written and prints what the README says it prints, and the
"More ways" block of docs/usage.md after it (the tree, a bfloat16 drafter, the compiled round and
StaticTarget, a draft vocabulary, batches) gives the target's greedy output every way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    """The README's "Use it" blocks, then docs/usage.md's."""
    text = (ROOT / "README.md").read_text()
    use_it = text[text.index("## Use it"):text.index("## Plug in a selector")]
    usage = (ROOT / "docs" / "usage.md").read_text()
    return re.findall(r"```python\n(.*?)```", use_it + usage, flags=re.S)


def test_the_runnable_python_blocks_run_as_written():
    blocks = python_blocks()
    first = blocks[0]
    assert "load_embedded" in first and "placeholder" not in first  # the runnable one, not the real-model one
    more = next(b for b in blocks if "greedy = ar_generate" in b)  # the "More ways" block
    out = subprocess.run([sys.executable, "-c", first + "\n" + more], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    tau, speedup = map(float, re.match(r"tau (\d+\.\d+), (\d+\.\d+)x plain decoding\n", out.stdout).groups())
    assert tau > 3  # the speed depends on the machine's load; τ does not
    assert speedup > 0
    assert out.stdout.rstrip().endswith("all ways gave the target's greedy output")


def test_the_loops_default_tree_is_the_one_the_readme_and_the_cli_use():
    import inspect

    from dflash2 import spec_generate, spec_generate_batch
    from dflash2.generate import build_parser

    cli = build_parser().parse_args([]).tree_nodes
    for fn in (spec_generate, spec_generate_batch):
        assert inspect.signature(fn).parameters["tree_nodes"].default == cli == 15


def test_what_is_where_names_every_module():
    """docs/architecture.md's "What is where" names every module of the flat core and every subpackage."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## What is where"):text.index("## Performance choices")]
    package = ROOT / "dflash2"
    names = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    names += [p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    missing = [n for n in names if n not in section]
    assert not missing, missing
