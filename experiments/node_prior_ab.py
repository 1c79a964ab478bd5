"""How strong a prior the adaptive tree row's node rates should start from: plain decoding against
TreeGoodputPolicy rows whose NodeRates count the optimistic prior (every node at UNKNOWN_CONFIDENCE)
as m rounds, on the embedded pair at batch 1, interleaved per prompt in one process (each policy
learns from its own rounds only, from scratch, as a server's would).

    python experiments/node_prior_ab.py [--strengths 8,2,1] [--greedy] [--prompts 20] [--repetitions 2]

Per repetition: each row's total tokens/s against plain decoding, and the drafting rounds each
policy has run so far (rounds that lose to a plain step at T = 1 on this pair).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.bench.methods import _Policies  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.policy.confidence import NodeRates  # noqa: E402
from dflash2.policy import UNKNOWN_CONFIDENCE, TreeGoodputPolicy  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strengths", default="8,2,1", help="prior strengths m to compare, comma-separated")
    p.add_argument("--greedy", action="store_true", help="greedy instead of T = 1, top-k 20, top-p 0.95")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--nodes", type=int, default=15)
    args = p.parse_args()
    tok, target, drafter = load_embedded()
    texts, _ = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in texts]
    step = StaticTarget(target, drafter.target_layer_ids, compile=True, linear_dtype="bfloat16")
    plain = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    d = drafter.with_config(block_size=16).to(torch.bfloat16)
    d.compile(dynamic=True)
    setting = dict(temperature=0.0, top_k=0, top_p=1.0) if args.greedy else dict(temperature=1.0, top_k=20, top_p=0.95)
    maker = _Policies(1, padded=False, calibrators={})
    maker(step, d, setting, args.nodes)  # profiles the costs once, as the bench does
    cost, draft_s, loop_s = maker.costs[(id(step), id(d), args.nodes)]
    policies = {float(m): TreeGoodputPolicy(cost, args.nodes, draft_s={1: draft_s}, loop_s={1: loop_s},
                                            rates=NodeRates(args.nodes, UNKNOWN_CONFIDENCE, prior_strength=float(m)))
                for m in args.strengths.split(",")}
    spec_generate(d, step, ids[0], max_new_tokens=32, verify="tree", tree_nodes=args.nodes)  # compiles
    ar_generate(plain, ids[0], max_new_tokens=8)
    totals = {row: [0, 0.0] for row in ["plain", *policies]}
    for rep in range(args.repetitions):
        for i, x in enumerate(ids):
            for row in totals:
                g = torch.Generator().manual_seed(1000 * rep + i)
                start = time.perf_counter()
                out = ar_generate(plain, x, max_new_tokens=128, generator=g, **setting) if row == "plain" else \
                    spec_generate(d, step, x, max_new_tokens=128, verify="tree", tree_nodes=args.nodes, generator=g,
                                  policy=policies[row], **setting)
                totals[row][1] += time.perf_counter() - start
                totals[row][0] += out.new_tokens.numel()
        base = totals["plain"][0] / totals["plain"][1]
        drafted = {m: sum(n for width, n in pol.chosen.items() if width >= 0) for m, pol in policies.items()}
        print(f"repetition {rep + 1}: " + ", ".join(f"m={row} {n / s / base:.3f}x" for row, (n, s) in totals.items()
                                                     if row != "plain")
              + f" plain decoding; drafting rounds so far {drafted}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
