"""Ablation grid on the embedded pair: conv × selector × top-K, τ on HumanEval prompts (greedy).

    python experiments/ablation/grid.py [--prompts 40] [--block-size 16]

conv comes from the two trained drafters (DFlash-1 weights: conv "none"; DFlash-2 weights: "two_tap");
selector and top-K are switched at inference on the same weights (argmax, walk, viterbi; K = 4, 8, 16).
The DFlash-1 drafter has no codebooks, so only argmax applies to it. Writes
docs/results/ablation_grid.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)  # the HumanEval prompts of eval_humaneval.py
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    tok, target, d2 = load_embedded("dflash2")
    _, _, d1 = load_embedded("dflash1")
    stops = [tok.eos_token_id]
    prompts = [tok(t, return_tensors="pt").input_ids for t in load_prompts("humaneval", args.prompts)[0]]
    refs = [ar_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).sequences for ids in prompts]
    grid = [("none", "argmax", 1, d1.with_config(block_size=args.block_size))]
    for selector in ("argmax", "walk", "viterbi"):
        for k in ((1,) if selector == "argmax" else (4, 8, 16)):
            grid.append(("two_tap", selector, k, d2.with_config(block_size=args.block_size, selector=selector,
                                                                selector_top_k=max(k, 1))))
    rows = []
    for conv, selector, k, drafter in grid:
        lengths, identical = [], 0
        for ids, ref in zip(prompts, refs):
            out = spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            lengths += out.acceptance_lengths
            identical += torch.equal(out.sequences, ref)
        rows.append(dict(conv=conv, selector=selector, top_k=k, tau=sum(lengths) / len(lengths),
                         identical=identical, prompts=len(prompts)))
        print(rows[-1])
    meta = dict(command=" ".join(sys.argv), date=str(datetime.date.today()), machine=platform.platform())
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation_grid.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print("\n| conv | selector | top-K | τ | identical to AR |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['conv']} | {r['selector']} | {r['top_k']} | {r['tau']:.2f} | {r['identical']}/{r['prompts']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
