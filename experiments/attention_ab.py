"""How StaticTarget's fused step attends in short passes: by matrix products (the shipped choice, passes
of at most `fused.PRODUCT_ATTENTION_UP_TO` tokens) against PyTorch's SDPA kernel for every pass, in
whole decodes on the embedded pair, both variants in one process, interleaved per repetition.

    python experiments/attention_ab.py [--prompts 20] [--repetitions 3]

Rows: plain decoding at 1, 8 and 32 rows in flight (continuous batching), a 15-node tree at batch 1
and a 7-node tree at 8 rows (greedy, 128 new tokens, HumanEval), every target step with bfloat16
products and compiled as the regimes table's rows are; the drafter in bfloat16 (eager). Outputs of
the two variants are compared (the arithmetic of a short pass's attention changes: identical
outputs are expected in most prompts, not all). Writes docs/results/attention_ab.json
(docs/architecture.md, "Performance choices").
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad, spec_generate_batch  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.targets.fused import PRODUCT_ATTENTION_UP_TO  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

VARIANTS = {"products": PRODUCT_ATTENTION_UP_TO, "sdpa": 0}  # passes of at most this many tokens by products


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" / "attention_ab.json")
    args = p.parse_args()
    monitor = LoadMonitor()  # from the start: the load before is the machine's, not this script's warm-up
    tok, target, drafter = load_embedded()
    target, d = target.float(), drafter.with_config(block_size=16).to(torch.bfloat16)
    prompts, source = load_prompts("humaneval", args.prompts)
    singles = [tok(t, return_tensors="pt").input_ids for t in prompts]
    ids, mask = left_pad([tok(t).input_ids for t in prompts])
    eos = [tok.eos_token_id]

    steps = {}
    for name, up_to in VARIANTS.items():
        plain = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
        spec = StaticTarget(target, d.target_layer_ids, compile=True, linear_dtype="bfloat16")
        for s in (plain, spec):
            if s.fused is None:
                raise SystemExit(f"StaticTarget runs the model's own layers here: {s.fused_reason}")
            s.fused.product_attention_up_to = up_to
        steps[name] = (plain, spec)

    def rows(name):
        plain, spec = steps[name]
        kw = dict(max_new_tokens=128, stop_token_ids=eos)
        return {
            "plain, 1 row": lambda: [ar_generate(plain, x, **kw) for x in singles],
            "plain, 8 rows": lambda: ar_generate_batch(plain, ids, mask, concurrency=8, **kw),
            "plain, 32 rows": lambda: ar_generate_batch(plain, ids, mask, concurrency=32, **kw),
            "tree15, 1 row": lambda: [spec_generate(d, spec, x, verify="tree", tree_nodes=15, **kw) for x in singles],
            "tree7, 8 rows": lambda: spec_generate_batch(d, spec, ids, mask, verify="tree", tree_nodes=7,
                                                         concurrency=8, **kw),
        }

    runs = {name: {row: [] for row in rows(name)} for name in VARIANTS}
    outputs = {}
    for name in VARIANTS:  # warm-up (every compiled graph, oneDNN's shapes); outputs kept for comparison
        outputs[name] = {row: [o.new_tokens for o in fn()] for row, fn in rows(name).items()}
    for rep in range(args.repetitions):
        for row in runs["products"]:
            for name in (VARIANTS if rep % 2 == 0 else reversed(list(VARIANTS))):  # interleaved, order alternating
                fn = rows(name)[row]
                start = time.perf_counter()
                outs = fn()
                seconds = time.perf_counter() - start
                runs[name][row].append(sum(o.new_tokens.numel() for o in outs) / seconds)
        print(f"repetition {rep + 1}/{args.repetitions} done", file=sys.stderr)
    load = monitor.record()

    summary = {}
    for row in runs["products"]:
        a, b = runs["products"][row], runs["sdpa"][row]
        same = sum(torch.equal(x, y) for x, y in zip(outputs["products"][row], outputs["sdpa"][row]))
        summary[row] = dict(products=statistics.median(a), sdpa=statistics.median(b),
                            ratios=[x / y for x, y in zip(a, b)], identical=f"{same} of {len(outputs['sdpa'][row])}")
    meta = dict(command="python experiments/attention_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                source=source, prompts=args.prompts, repetitions=args.repetitions, load=load,
                product_attention_up_to=PRODUCT_ATTENTION_UP_TO)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=2) + "\n")
    print(f"load: {load}\n\n| row | products, tokens/s | SDPA, tokens/s | products / SDPA, per repetition | identical outputs |")
    print("|---|---|---|---|---|")
    for row, s in summary.items():
        print(f"| {row} | {s['products']:.0f} | {s['sdpa']:.0f} | {', '.join(f'{r:.3f}' for r in s['ratios'])} | "
              f"{s['identical']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
