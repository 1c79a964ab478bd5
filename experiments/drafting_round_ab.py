"""A drafting round as one compiled graph against two, measured interleaved in one process.

    python experiments/drafting_round_ab.py [--prompts 10] [--repetitions 3] [--out docs/results/drafting_round_ab.json]

On the embedded pair (float32 target, bfloat16 drafter, 2 threads; run it quiet: nothing else running),
whole decodes with 15-node trees on HumanEval prompts, 128 new tokens, greedy:
  * "backbone.compile": the block pass and the context projection compiled separately (two graph
    calls per round), the LM head, top-K and the lattice's scores eager;
  * "drafter.compile": the whole round (projection, block pass, LM head, top-K, lattice) as one graph;
each with StaticTarget's verification eager and compiled, and our plain decoding (StaticTarget's
one-token step) for the ratio. Every variant decodes each prompt in turn, so drift of the machine's
speed touches all alike; tokens/s by totals per repetition. Every output must equal plain decoding's.
The load record is written beside the numbers; docs/architecture.md ("Performance choices") cites them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash2 import StaticTarget, ar_generate, spec_generate  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.embedded import load_embedded  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "drafting_round_ab.json")
    args = parser.parse_args(argv)
    monitor = LoadMonitor()
    tokenizer, target, drafter = load_embedded("dflash2")
    target, drafter = target.float(), drafter.to(torch.bfloat16)
    two, one = copy.deepcopy(drafter), copy.deepcopy(drafter)
    two.backbone.compile(dynamic=True)
    one.compile(dynamic=True)
    layers = tuple(drafter.target_layer_ids)
    eager, compiled, plain = StaticTarget(target, layers), StaticTarget(target, layers, compile=True), StaticTarget(target)

    def tree(d, tgt):
        return lambda ids: spec_generate(d, tgt, ids, max_new_tokens=128, verify="tree", tree_nodes=15, stop_token_ids=[0])

    variants = {"backbone.compile, eager verify": tree(two, eager), "backbone.compile, compiled verify": tree(two, compiled),
                "drafter.compile, eager verify": tree(one, eager), "drafter.compile, compiled verify": tree(one, compiled),
                "plain decoding": lambda ids: ar_generate(plain, ids, max_new_tokens=128, stop_token_ids=[0])}
    prompts, _ = load_prompts("humaneval", args.prompts)
    encoded = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    t0 = time.perf_counter()
    with torch.no_grad():
        for run in variants.values():  # compile every graph (warm-up), outside the clock
            for ids in encoded[:2]:
                run(ids)
    warm_s = time.perf_counter() - t0
    runs = []
    same = True
    for rep in range(args.repetitions):
        totals = {k: [0, 0.0, 0] for k in variants}
        for ids in encoded:
            outs = {}
            for name, run in variants.items():
                out = run(ids)
                outs[name] = out.new_tokens.tolist()
                totals[name][0] += out.new_tokens.numel()
                totals[name][1] += out.total_s
                totals[name][2] += out.num_rounds
            same &= all(o == outs["plain decoding"] for o in outs.values())
        runs.append({k: dict(tokens_per_s=round(n / s, 1), tau=round((n - len(encoded)) / r, 3))
                     for k, (n, s, r) in totals.items()})
        print(rep, {k: v["tokens_per_s"] for k, v in runs[-1].items()}, flush=True)
    result = dict(meta=dict(command=" ".join(["python experiments/drafting_round_ab.py", *(argv or sys.argv[1:])]),
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cpu=cpu_description(),
                            torch=torch.__version__, prompts=len(encoded), warm_up_s=round(warm_s, 1),
                            load=monitor.record()),
                  outputs_equal_plain_decoding=same, repetitions=runs)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["meta"]["load"]), "outputs equal:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
