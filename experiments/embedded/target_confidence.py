"""How sure the embedded target is of its own greedy output, per prompt set, next to the drafter's τ.

    python experiments/embedded/target_confidence.py [--prompts 40] [--max-new-tokens 128]

A drafter can only agree with the target's argmax. Where the target's top-1 probability is low, its
choice hangs on details no small drafter reproduces, 1 to 15 tokens ahead. This script decodes each
prompt greedily and records p(top-1) at every generated token, and the path τ of the shipped DFlash-2
drafter on the same prompts (B = 16). Writes docs/results/target_confidence.json and prints a table.
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


@torch.no_grad()
def top1_probs(target, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """p(top-1) of the target at each generated position of a greedy sequence [1, T]."""
    logits = target(input_ids=sequence).logits[0, prompt_len - 1: -1].double()
    return logits.softmax(-1).max(-1).values


def markdown_table(rows: list[dict]) -> list[str]:
    """The table of docs/results.md's confidence section (also printed by main)."""
    return ["| prompt set | prompts | tokens | mean p(top-1) | p(top-1) < 0.5 | p(top-1) > 0.9 | τ DFlash-2 |",
            "|---|---|---|---|---|---|---|",
            *[f"| {r['dataset']} | {r['prompts']} | {r['tokens']} | {r['mean_top1_prob']:.3f} | "
              f"{r['frac_top1_below_half']:.1%} | {r['frac_top1_above_09']:.1%} | {r['tau_dflash2']:.2f} |"
              for r in rows]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--datasets", nargs="+", default=["humaneval", "stdlib_heldout"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "target_confidence.json")
    args = p.parse_args()
    tok, target, drafter = load_embedded(variant="dflash2")
    stops = [tok.eos_token_id]
    rows = []
    for name in args.datasets:
        texts, source = load_prompts(name, args.prompts)
        probs, lengths = [], []
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids
            ref = ar_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).sequences
            probs.append(top1_probs(target, ref, ids.shape[1]))
            lengths += spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens,
                                     stop_token_ids=stops).acceptance_lengths
        p1 = torch.cat(probs)
        rows.append(dict(dataset=name, source=source, prompts=len(texts), tokens=int(p1.numel()),
                         mean_top1_prob=float(p1.mean()), frac_top1_below_half=float((p1 < 0.5).double().mean()),
                         frac_top1_above_09=float((p1 > 0.9).double().mean()),
                         tau_dflash2=sum(lengths) / max(1, len(lengths))))
    print("\n".join(markdown_table(rows)))
    meta = dict(command=" ".join(sys.argv), date=str(datetime.date.today()), machine=platform.platform(),
                torch=torch.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
