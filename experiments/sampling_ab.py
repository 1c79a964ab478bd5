"""Plain sampled decoding (T = 1, top-k 20, top-p 0.95) with the package's sampling against the ways it
sampled before, and `process_logits` timed alone. One process, the earlier code swapped in by patching
the modules that call it, interleaved (the order reversed on odd repetitions); our plain decoding
through a compiled StaticTarget with bfloat16 products, HumanEval prompts, 128 new tokens, at 1 row
(prompt by prompt) and at N rows in flight. The variants:

    sort     top-p over a sort of the whole row, `torch.multinomial` over the vocabulary for each draw
    columns  top-p over the columns top-k kept, the other operators over the whole row; one uniform
             against the float64 cumulative mass per draw, the batched step drawing row by row
    now      the package: everything after the top-k over the kept columns, the batched step's rows
             drawn in one go (TorchRandom.categorical_rows)

    python experiments/sampling_ab.py [--prompts 20] [--repetitions 4] [--rows 1,8,32] [--variants sort,columns,now]

Writes docs/results/sampling_ab.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash2.decoding.batch  # noqa: E402
import dflash2.decoding.round  # noqa: E402
import dflash2.decoding.sampling  # noqa: E402
import dflash2.decoding.tree  # noqa: E402
import dflash2.decoding.verify  # noqa: E402
from dflash2 import ar_generate, ar_generate_batch, load_embedded  # noqa: E402
from dflash2.decoding.batch import left_pad  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.decoding.rng import TorchRandom  # noqa: E402
from dflash2.decoding.sampling import SamplingParams  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402


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


def process_logits_columns(logits, params):
    """process_logits at 8ab6506: top-p over the kept columns; the mask, its count and the softmax over
    the whole row."""
    scores = logits.float() if logits.dtype != torch.float64 else logits
    if params.temperature != 1.0:
        scores = scores / params.temperature
    columns = None
    if params.top_k:
        k = min(params.top_k, scores.size(-1))
        top_scores, top_idx = torch.topk(scores, k)
        scores = scores.masked_fill(scores < top_scores[..., -1:], -math.inf)
        if params.top_p < 1.0:
            m = int((scores > -math.inf).sum(-1).max())
            columns = (top_idx if m == k else torch.topk(scores, m)[1]).sort(-1)[0]
    if params.top_p < 1.0:
        if columns is None:
            sorted_scores, sorted_idx = torch.sort(scores, descending=False, stable=True)
        else:
            sorted_scores, order = torch.sort(scores.gather(-1, columns), stable=True)
            sorted_idx = columns.gather(-1, order)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - params.top_p)
        sorted_remove[..., -1:] = False
        remove = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores.softmax(dim=-1)


VARIANTS = {  # name: (process_logits, TorchRandom.categorical, whether the batched step draws its rows in one go)
    "sort": (process_logits_before, categorical_before, False),
    "columns": (process_logits_columns, TorchRandom.categorical, False),
    "now": (dflash2.decoding.sampling.process_logits, TorchRandom.categorical, True),
}


CALLERS = (dflash2.decoding.batch, dflash2.decoding.round, dflash2.decoding.tree, dflash2.decoding.verify)


@contextmanager
def sampling(which: str):
    """The sampling of `which` (a VARIANTS key) while inside."""
    saved = [m.process_logits for m in CALLERS], TorchRandom.categorical, TorchRandom.categorical_rows
    process, categorical, rows_at_once = VARIANTS[which]
    for m in CALLERS:
        m.process_logits = process
    TorchRandom.categorical = categorical
    if not rows_at_once:  # dflash2.decoding.rng.categorical_rows then asks the source row by row
        del TorchRandom.categorical_rows
    try:
        yield
    finally:
        for m, f in zip(CALLERS, saved[0]):
            m.process_logits = f
        TorchRandom.categorical, TorchRandom.categorical_rows = saved[1], saved[2]


def time_process_logits(variants: list[str], rows: list[int], vocab: int, calls: int, repetitions: int) -> list[dict]:
    """Microseconds per process_logits call on [R, vocab] float32 logits (T = 1, top-k 20, top-p 0.95),
    each variant `calls` calls in a row, interleaved over `repetitions`; the median per variant."""
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    g = torch.Generator().manual_seed(0)
    out = []
    for r in rows:
        logits = [4 * torch.randn(r, vocab, generator=g) for _ in range(16)]
        times = {v: [] for v in variants}
        for rep in range(repetitions + 1):  # the first pass warms up
            for v in (variants if rep % 2 == 0 else variants[::-1]):
                f = VARIANTS[v][0]
                start = time.perf_counter()
                for i in range(calls):
                    f(logits[i % 16], params)
                if rep:
                    times[v].append(1e6 * (time.perf_counter() - start) / calls)
        out.append(dict(rows=r, vocab=vocab, us=times, median_us={v: statistics.median(t) for v, t in times.items()}))
    return out


def time_one_draw(vocab: int, calls: int, repetitions: int) -> dict:
    """Microseconds per draw from one row [vocab]: TorchRandom.categorical against categorical_rows over
    that row as a [1, vocab] batch (the same draw), interleaved; the median per way."""
    rng = TorchRandom(torch.Generator().manual_seed(0))
    probs = torch.softmax(4 * torch.randn(vocab, generator=torch.Generator().manual_seed(1)), 0)
    ways = {"categorical": lambda: rng.categorical(probs), "categorical_rows, one row": lambda: rng.categorical_rows(probs[None])}
    times = {w: [] for w in ways}
    for rep in range(repetitions + 1):  # the first pass warms up
        for w in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                ways[w]()
            if rep:
                times[w].append(1e6 * (time.perf_counter() - start) / calls)
    return dict(vocab=vocab, us=times, median_us={w: statistics.median(t) for w, t in times.items()})


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=4)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--variants", default="sort,columns,now")
    p.add_argument("--calls", type=int, default=2000, help="process_logits calls per timing (0: no timing alone)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" / "sampling_ab.json")
    args = p.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS) or "now" not in variants:
        p.error(f"--variants takes some of {', '.join(VARIANTS)}, now among them; got {args.variants}")
    cases = [int(r) for r in args.rows.split(",")]
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

    alone = time_process_logits(variants, cases, target.config.vocab_size, args.calls, 5) if args.calls else []
    for r in alone:
        times = ", ".join(f"{v} {r['median_us'][v]:.1f} µs" for v in variants)
        print(f"process_logits alone, {r['rows']} × {r['vocab']}: {times}")
    draw = time_one_draw(target.config.vocab_size, 10 * args.calls, 5) if args.calls else None
    if draw:
        print("one draw: " + ", ".join(f"{w} {us:.1f} µs" for w, us in draw["median_us"].items()))
    for rows in cases:  # compiles, first calls
        for which in variants:
            with sampling(which):
                decode(rows, 0)
    runs = {(rows, which): [] for rows in cases for which in variants}
    for rep in range(args.repetitions):
        for rows in cases:
            for which in (variants if rep % 2 == 0 else variants[::-1]):
                with sampling(which):
                    start = time.perf_counter()
                    tokens = decode(rows, 1000 + rep)
                    runs[rows, which].append(tokens / (time.perf_counter() - start))
    load = monitor.record()
    table = []
    print(f"{'rows':>4} " + " ".join(f"{v:>9}" for v in variants) + "  now / each")
    for rows in cases:
        medians = {v: statistics.median(runs[rows, v]) for v in variants}
        table.append(dict(rows=rows, tokens_per_s={v: runs[rows, v] for v in variants}, median=medians,
                          ratio_now={v: medians["now"] / medians[v] for v in variants if v != "now"}))
        print(f"{rows:>4} " + " ".join(f"{medians[v]:>9.1f}" for v in variants) + "  "
              + ", ".join(f"{medians['now'] / medians[v]:.2f}× {v}" for v in variants if v != "now"))
    meta = dict(command="python experiments/sampling_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                prompts=args.prompts, repetitions=args.repetitions, source=source, variants=variants, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=table, process_logits_alone=alone, one_draw=draw), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
