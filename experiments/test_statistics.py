"""Run the test suite and write docs/test-statistics.md: Hypothesis examples per property and the
branch counts of the exact-distribution enumeration.

    python experiments/test_statistics.py            # the default (CI) Hypothesis profile
    HYPOTHESIS_PROFILE=deep python experiments/test_statistics.py
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "test-statistics.md"


def main() -> int:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "--hypothesis-show-statistics",
           "-m", "slow or not slow",  # the deep checks too: their numbers are recorded
           "tests/decoding/test_greedy_equality.py", "tests/drafter/test_modules.py", "tests/decoding/test_sampling.py",
           "tests/decoding/test_exact_distribution.py", "tests/decoding/test_monte_carlo.py",
           "tests/decoding/test_tree_decoding.py", "tests/decoding/test_batch.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = proc.stdout
    examples = []
    for block in re.split(r"\n(?=tests/\S+::\S+:\n)", text):
        head = re.match(r"(tests/\S+::\S+):\n", block)
        counts = re.search(r"(\d+) passing, (\d+) failing, and (\d+) invalid", block)
        if head and counts:
            examples.append((head.group(1), int(counts.group(1)), int(counts.group(2)), int(counts.group(3))))
    branches = re.findall(r"^\.*(\S+ \S+): (\d+) branches, (\d+) outcomes, round lengths (\[.*?\])", text, re.M)
    tree_batch = re.findall(r"^\.*(\S+ \S+): (\d+) branches, acceptance lengths (\[.*?\])", text, re.M)
    mutants = re.findall(r"^\.*(\S+): max deviation (\S+)", text, re.M)
    chi = re.findall(r"^\.*(SamplingParams\(.*?\)): chi-square p = (\S+)", text, re.M)
    hist = re.findall(r"acceptance lengths over (\d+) runs: (\{.*?\})", text)
    summary = [line for line in text.splitlines() if re.search(r"\d+ passed", line)]
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    lines = [
        "# Test statistics",
        "",
        f"Written by `python experiments/test_statistics.py` (Hypothesis profile `{profile}`).",
        f"Provenance: {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}.",
        f"pytest: `{summary[-1].strip('= ') if summary else 'no summary line'}`",
        "",
        "## Hypothesis examples per property",
        "",
        "| property | passing | failing | invalid |",
        "|---|---|---|---|",
        *[f"| `{name}` | {p} | {f} | {i} |" for name, p, f, i in examples],
        "",
        "## Exact distribution by enumeration (vocabulary 3, 4 new tokens, block size 3)",
        "",
        "Every branch of the random source is run; the output distribution must equal the AR one to 1e-12.",
        "",
        "| drafter, sampling | branches run | outcomes | acceptance lengths seen |",
        "|---|---|---|---|",
        *[f"| {case} | {b} | {o} | {lengths} |" for case, b, o, lengths in branches],
        "",
        "## Tree verification and batches by enumeration (vocabulary 3)",
        "",
        "`tests/decoding/test_tree_decoding.py`: `spec_generate(verify=\"tree\")`, 4 new tokens, trees of width <= 3 "
        "and depth <= 3; "
        "`tests/decoding/test_batch.py`: a 2-row ragged batch, 3 new tokens per row, against the product of the rows' AR "
        "distributions. Both to 1e-12.",
        "",
        "| case | branches run | acceptance lengths seen |",
        "|---|---|---|",
        *[f"| {case} | {b} | {lengths} |" for case, b, lengths in tree_batch],
        "",
        "## Mutants (must deviate by more than 1e-4)",
        "",
        "| mutant | max deviation from the AR distribution |",
        "|---|---|",
        *[f"| {name} | {dev} |" for name, dev in mutants],
        "",
        "## Monte Carlo (3000 runs of spec_generate per row, chi-square against the exact AR distribution)",
        "",
        "| sampling | p-value |",
        "|---|---|",
        *[f"| `{params}` | {p} |" for params, p in chi],
        "",
        "Acceptance-length histograms of those runs (the last row is the mutant run, which must fail):",
        "",
        *[f"- {n} runs: {h}" for n, h in hist],
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT} ({len(examples)} properties, {len(branches)} enumerations); pytest exit code {proc.returncode}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
