"""Plain sampled decoding (T = 1, top-k 20, top-p 0.95) with the package's sampling against the way it
sampled before: top-p over a sort of the whole row, and `torch.multinomial` over the vocabulary for
each draw (now: top-p over the columns top-k kept, and one uniform against the float64 cumulative
mass). One process, the two swapped in by patching the modules that call them, interleaved ABBA per
repetition; our plain decoding through a compiled StaticTarget with bfloat16 products, HumanEval
prompts, 128 new tokens, at 1 row (prompt by prompt) and at N rows in flight.

    python experiments/sampling_ab.py [--prompts 20] [--repetitions 4] [--rows 1,8,32]

Writes docs/results/sampling_ab.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash2.batch  # noqa: E402
import dflash2.round  # noqa: E402
import dflash2.tree  # noqa: E402
import dflash2.verify  # noqa: E402
from dflash2 import ar_generate, ar_generate_batch, load_embedded  # noqa: E402
from dflash2.batch import left_pad  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.rng import TorchRandom  # noqa: E402
from dflash2.target.static import StaticTarget  # noqa: E402


def process_logits_before(logits, params):
    """The sampling module's process_logits before top-p read only the kept columns."""
    scores = logits.float() if logits.dtype != torch.float64 else logits
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.size(-1)))[0][..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - params.top_p)
        sorted_remove[..., -1:] = False
        scores = scores.masked_fill(sorted_remove.scatter(-1, sorted_idx, sorted_remove), -math.inf)
    return scores.softmax(dim=-1)


def categorical_before(self, probs):
    return int(torch.multinomial(probs, 1, generator=self.generator).item())


CALLERS = (dflash2.batch, dflash2.round, dflash2.tree, dflash2.verify)


@contextmanager
def sampling(which: str):
    """The package's sampling ("after") or the earlier one ("before") while inside."""
    saved = [m.process_logits for m in CALLERS], TorchRandom.categorical
    if which == "before":
        for m in CALLERS:
            m.process_logits = process_logits_before
        TorchRandom.categorical = categorical_before
    try:
        yield
    finally:
        for m, f in zip(CALLERS, saved[0]):
            m.process_logits = f
        TorchRandom.categorical = saved[1]


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=4)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" / "sampling_ab.json")
    args = p.parse_args()
    monitor = LoadMonitor()
    tok, target, _ = load_embedded()
    texts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in texts]
    step = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    kw = dict(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=128)

    def decode(rows: int, seed: int) -> int:
        g = torch.Generator().manual_seed(seed)
        if rows == 1:
            return sum(ar_generate(step, x, generator=g, **kw).new_tokens.numel() for x in ids)
        return sum(o.new_tokens.numel() for o in ar_generate_batch(step, *left_pad(ids), concurrency=rows, generator=g, **kw))

    cases = [int(r) for r in args.rows.split(",")]
    for rows in cases:  # compiles, first calls
        for which in ("before", "after"):
            with sampling(which):
                decode(rows, 0)
    runs = {(rows, which): [] for rows in cases for which in ("before", "after")}
    for rep in range(args.repetitions):
        for rows in cases:
            for which in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                with sampling(which):
                    start = time.perf_counter()
                    tokens = decode(rows, 1000 + rep)
                    runs[rows, which].append(tokens / (time.perf_counter() - start))
    load = monitor.record()
    table = []
    print(f"{'rows':>4} {'before':>9} {'after':>9} {'after/before':>12}")
    for rows in cases:
        before, after = (sorted(runs[rows, w])[len(runs[rows, w]) // 2] for w in ("before", "after"))
        table.append(dict(rows=rows, before=runs[rows, "before"], after=runs[rows, "after"], median_before=before,
                          median_after=after, ratio=after / before))
        print(f"{rows:>4} {before:>9.1f} {after:>9.1f} {after / before:>11.2f}×")
    meta = dict(command="python experiments/sampling_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                prompts=args.prompts, repetitions=args.repetitions, source=source, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=table), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
