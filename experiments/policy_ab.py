"""The adaptive tree row against the fixed one at batch 1, outside the bench: a StaticTarget per target
step (float32, bfloat16 products) and a compiled drafter per step (--shared: one for both, as the
bench had it), the rows interleaved per prompt as the bench runs them, and what each step's policy
learned (skipped rounds, the drafting seconds it expects, its residuals). A check of the bench's
adaptive rows, where a policy can be seen skipping rounds that a fixed row shows to pay.

    python experiments/policy_ab.py [--prompts 10] [--repetitions 2] [--nodes 15] [--shared]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import load_embedded, spec_generate  # noqa: E402
from dflash2.bench.methods import _Policies  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--nodes", type=int, default=15)
    p.add_argument("--shared", action="store_true", help="one compiled drafter for both steps")
    args = p.parse_args()
    tok, target, drafter = load_embedded()
    d = drafter.with_config(block_size=16).to(torch.bfloat16)
    prompts, _ = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in prompts]
    steps = {"float32": StaticTarget(target, d.target_layer_ids, compile=True),
             "bf16mm": StaticTarget(target, d.target_layer_ids, compile=True, linear_dtype="bfloat16")}
    fast = {k: copy.deepcopy(d) for k in (("shared",) if args.shared else steps)}
    for one in fast.values():
        one.compile(dynamic=True)
    fast = {k: fast["shared"] if args.shared else fast[k] for k in steps}
    greedy = dict(temperature=0.0, top_k=0, top_p=1.0)
    make = _Policies(1, padded=False, calibrators={})
    policies = {k: make(st, fast[k], greedy, args.nodes) for k, st in steps.items()}
    for k, st in steps.items():  # compile outside the timed runs
        spec_generate(fast[k], st, ids[0], max_new_tokens=16, verify="tree", tree_nodes=args.nodes)
    totals = {f"{row} {k}": [0, 0.0] for k in steps for row in ("fixed", "adaptive")}
    for rep in range(args.repetitions):
        for x in ids:
            for k, st in steps.items():
                for row in ("fixed", "adaptive"):
                    t = time.perf_counter()
                    out = spec_generate(fast[k], st, x, max_new_tokens=128, verify="tree", tree_nodes=args.nodes,
                                        policy=policies[k] if row == "adaptive" else None, **greedy)
                    totals[f"{row} {k}"][0] += out.new_tokens.numel()
                    totals[f"{row} {k}"][1] += time.perf_counter() - t
        print(f"repetition {rep + 1}: " + ", ".join(f"{name} {n / s:.0f} tok/s" for name, (n, s) in totals.items()))
    for k, policy in policies.items():
        rounds = sum(policy.chosen.values())
        print(f"{k}: skipped {policy.chosen.get(-1, 0)} of {rounds} rounds; drafting expected "
              f"{ {r: round(1e3 * s, 2) for r, s in policy.draft_s.items()} } ms; residuals "
              f"{ {kind: {r: round(1e3 * s, 2) for r, s in t.items()} for kind, t in policy.timer.residuals.items()} } ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
