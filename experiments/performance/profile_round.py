"""Where a round's time goes, stage by stage, on the embedded pair; and before/after ratios of the
optimisations of the batched drafter, measured interleaved in one process.

    python experiments/performance/profile_round.py [--threads 2] [--repeats 200] [--drafter-dtype bfloat16]

Single row (HumanEval prompt 0, B = 16): target forward of 1 token (an AR step) and of a 16-token
block, and the drafter's stages (context projection, backbone, LM head, top-K, selector).
Batched drafting (8 rows): "before" is each row drafting alone (`propose` row by row); "after"
is `propose_batch` over the rows' ContextBatch (one projection, one backbone pass, the greedy walk
of all rows at once). Medians over repeats; the two variants alternate. Writes docs/results/profile_round.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import TargetAdapter, TorchRandom, load_embedded  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


@torch.no_grad()  # as in decoding: tensors built with autograd on (caches, features) make later ops slower
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--drafter-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "profile_round.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok, target, drafter = load_embedded("dflash2")
    target, drafter = target.float(), drafter.to(getattr(torch, args.drafter_dtype))
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    rng = TorchRandom(torch.Generator().manual_seed(0))
    texts, _ = load_prompts("humaneval", args.rows)
    prompts = [tok(t, return_tensors="pt").input_ids for t in texts]

    # -- one row ---------------------------------------------------------------------------------
    cache = adapter.new_cache()
    step = adapter.forward(prompts[0], cache)
    block = torch.full((1, drafter.block_size), 5)

    def target_pass(ids):
        s = adapter.forward(ids, cache)
        adapter.rollback(cache, s, 0)

    ctx = drafter.new_cache()
    drafter.backbone.extend_context(ctx, step.features[:, :-2])
    new = step.features[:, -2:]  # a round's new context: the anchor and one accepted token
    hidden = drafter.block_hidden(ctx, 5, adapter)[0, 1:]
    logits = drafter.draft_logits(hidden, adapter)
    cands = drafter.candidates(logits)
    stages = {
        "target: 1 token (an AR step)": lambda: target_pass(block[:, :1]),
        "target: 16-token block (verify)": lambda: target_pass(block),
        "drafter: context projection (2 new positions)": lambda: drafter.backbone.extend_context(copy.copy(ctx), new),
        "drafter: backbone (block of 16)": lambda: drafter.block_hidden(ctx, 5, adapter),
        "drafter: LM head (15 positions)": lambda: drafter.draft_logits(hidden, adapter),
        "drafter: top-K": lambda: drafter.candidates(logits),
        "drafter: walk selector": lambda: drafter.candidate_selector(cands, hidden, 5, 0.0, rng),
        "drafter: propose (all of the above)": lambda: drafter.propose(copy.copy(ctx), 5, new, adapter, 0.0, rng),
    }
    with torch.no_grad():
        single = {name: median_ms(fn, args.repeats) for name, fn in stages.items()}

    # -- batched drafting: each row alone / all rows in one pass, interleaved --------------------------
    feats = [adapter.forward(ids, adapter.new_cache()).features for ids in prompts]
    caches = [drafter.new_cache() for _ in feats]
    drafter.backbone.extend_contexts(caches, [f[:, :-2] for f in feats])
    context = drafter.new_context_batch()
    context.add_rows(len(feats))
    drafter.backbone.extend_batch(context, [f[:, :-2] for f in feats], drafter.block_size)
    news, lengths = [f[:, -2:] for f in feats], list(context.lengths)
    anchors = [5] * len(feats)

    def after():  # one pass over the rows' ContextBatch; resetting the lengths undoes the extension
        context.lengths = list(lengths)
        return drafter.propose_batch(context, anchors, news, adapter, 0.0, rng)

    def before():  # each row drafts alone from its own cache, as spec_generate does
        return [drafter.propose(copy.copy(c), a, f, adapter, 0.0, rng) for c, a, f in zip(caches, anchors, news)]

    with torch.no_grad():
        same = [d.tokens.tolist() for d in before()] == [d.tokens.tolist() for d in after()]
        timings = {"before": [], "after": []}
        for _ in range(max(10, args.repeats // 4)):
            for name, fn in (("before", before), ("after", after)):  # interleaved
                t = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - t)
    batched = {name: 1e3 * statistics.median(v) for name, v in timings.items()}
    if not same:
        raise SystemExit("the rows drafted alone and in one pass differ")

    result = dict(meta=dict(command="python " + " ".join(sys.argv), date=str(datetime.date.today()),
                            machine=platform.platform(), threads=args.threads, repeats=args.repeats,
                            drafter_dtype=args.drafter_dtype, cpu=cpu_description()),
                  single_row_ms=single, batched_drafting_ms=batched,
                  batched_drafting_speedup=batched["before"] / batched["after"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| stage | ms (median) |\n|---|---|")
    for name, ms in single.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"\nbatched drafting, {len(feats)} rows: before {batched['before']:.2f} ms, after {batched['after']:.2f} ms, "
          f"speedup {result['batched_drafting_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
