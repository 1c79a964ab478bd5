"""Prompts for drafter training data: code from the train split, in two kinds, equally many.

    python experiments/embedded/build_prompts.py [--out runs/embedded/prompts.pt] [--tokens 96]

Each prompt is the last `--tokens` tokens of a train-split file up to and including either
* a line that starts a function (`def ...:`): the target goes on with a docstring and a body, or
* the end of a function's docstring: the target goes on with the body, the shape of a HumanEval
  prompt (signature + docstring) and of the held-out prompt set, without using either.
Written as a list of token-id lists, the format `dflash2.train` reads for `data.prompts`.
"""

from __future__ import annotations

import argparse
import ast
import random
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
    def_ends, doc_ends = [], []
    for text in read_texts("train"):
        def_ends += [(text, m.end()) for m in DEF_LINE.finditer(text)]
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        starts = [0]  # character offset of every line
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                doc_ends.append((text, starts[node.body[0].end_lineno]))  # after the docstring's last line

    def cut(text: str, end: int) -> list[int] | None:
        ids = tok(text[max(0, end - 6 * tokens): end]).input_ids[-tokens:]  # ~6 characters a token at most
        return ids if len(ids) == tokens else None

    kinds = [[p for p in map(lambda te: cut(*te), ends) if p] for ends in (def_ends, doc_ends)]
    n = min(map(len, kinds))
    rng = random.Random(0)
    return [p for kind in kinds for p in rng.sample(kind, n)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "embedded" / "prompts.pt")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    prompts = build(args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(prompts, args.out)
    print(f"wrote {len(prompts)} prompts of {args.tokens} tokens to {args.out}")
