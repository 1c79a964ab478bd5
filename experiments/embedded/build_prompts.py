"""Prompts for drafter training data: code from the train split, each ending with a `def` line.

    python experiments/embedded/build_prompts.py [--out runs/embedded/prompts.pt] [--tokens 64]

Each prompt is the last `--tokens` tokens of a train-split file up to and including a line that
starts a function (`def ...:`), so the target's continuation (the regenerated response) is code.
Written as a list of token-id lists, the format `dflash2.train` reads for `data.prompts`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from dflash2.corpus import read_texts  # noqa: E402

DEF_LINE = re.compile(r"^[ \t]*(async[ \t]+)?def [^\n]*:[ \t]*\n", re.M)


def build(tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "dflash2" / "embedded" / "tokenizer"))
    prompts = []
    for text in read_texts("train"):
        for match in DEF_LINE.finditer(text):
            head = text[max(0, match.end() - 6 * tokens): match.end()]  # ~6 characters a token at most
            ids = tok(head).input_ids[-tokens:]
            if len(ids) == tokens:
                prompts.append(ids)
    return prompts


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "embedded" / "prompts.pt")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    prompts = build(args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(prompts, args.out)
    print(f"wrote {len(prompts)} prompts of {args.tokens} tokens to {args.out}")
