"""Is the generation loop compute-bound or Python-bound? cProfile over whole `spec_generate` calls
on the embedded pair (HumanEval prompts, greedy, B = 16, 128 new tokens), summarised as shares of
the profiled wall time.

    python experiments/performance/cprofile_loop.py [--prompts 6] [--threads 1] [--top 0]

Shares: `torch._C._nn.linear` (matrix products: compute), scaled-dot-product attention, the target's
forward (`TargetAdapter.forward`, cumulative), the drafter's `propose` (cumulative), and the
bookkeeping of `nn.Module.__call__` / `__getattr__` (Python overhead). cProfile itself slows Python
code, so the overhead share is an upper bound. `--top N` also prints the N largest functions.
Writes docs/results/cprofile_loop.json (shown by experiments/embedded/report.py).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import platform
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "cprofile_loop.json"
sys.path.insert(0, str(ROOT))

from dflash2 import load_embedded, spec_generate  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402

SHARES = {  # label: (file suffix, function name, use cumulative time)
    "matrix products (torch linear)": ("~", "<built-in method torch._C._nn.linear>", False),
    "attention (SDPA)": ("~", "<built-in method torch._C._nn.scaled_dot_product_attention>", False),
    "target forward (cumulative)": ("dflash2/targets/adapter.py", "forward", True),
    "drafter propose (cumulative)": ("dflash2/drafter/model.py", "propose", True),
    "nn.Module call bookkeeping": ("torch/nn/modules/module.py", "_call_impl", False),
    "nn.Module attribute lookups": ("torch/nn/modules/module.py", "__getattr__", False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok, target, drafter = load_embedded()
    prompts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(text, return_tensors="pt").input_ids for text in prompts]
    spec_generate(drafter, target, ids[0], max_new_tokens=16)  # warm-up outside the profile

    profile = cProfile.Profile()
    profile.enable()
    rounds = sum(spec_generate(drafter, target, x, max_new_tokens=128).num_rounds for x in ids)
    profile.disable()

    stats = pstats.Stats(profile)
    total = stats.total_tt
    print(f"{source}; {rounds} rounds, {total:.2f} s profiled, {args.threads} thread(s)\n")
    shares = {}
    for label, (suffix, name, cumulative) in SHARES.items():
        seconds = sum(row[3] if cumulative else row[2] for (file, _, func), row in stats.stats.items()
                      if func == name and file.endswith(suffix))
        shares[label] = seconds / total
    print("| share of wall time | % |\n|---|---|", *[f"| {k} | {100 * v:.0f} |" for k, v in shares.items()], sep="\n")
    meta = dict(command="python experiments/performance/cprofile_loop.py " + " ".join(sys.argv[1:]),
                date=datetime.date.today().isoformat(), machine=platform.platform(), threads=args.threads,
                source=source, rounds=rounds, profiled_s=total)
    OUT.write_text(json.dumps(dict(meta=meta, shares=shares), indent=2) + "\n")
    print(f"\nwrote {OUT.relative_to(ROOT)}")
    if args.top:
        print()
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
