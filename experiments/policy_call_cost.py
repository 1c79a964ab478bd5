"""What the adaptive policy's own call costs in a round it skips: `drafts(rows)` on a GoodputPolicy and
a TreeGoodputPolicy settled into skipping (drafting priced far above a plain step), timed per call
with the policy's real clock on, at 1, 8 and 32 rows, and beside it an empty Python call; each policy
as it runs (quiet stretches: most settled skips answered by a counter) and with every call judging and
timing its round (quiet_rounds = 0: closing the round before it, the share test, opening the next).
No model runs: the call's work does not depend on the model, only on the policy's bookkeeping.
Alone in a tight loop the call runs from warm caches; --loop also times every call inside a real
decode (the embedded pair, 8 rows in flight, T = 1, the bench's adaptive 15-node tree policy settled
over the prompt set three times first), where the target's passes run between two calls, the full
calls apart from the quiet ones.

    python experiments/policy_call_cost.py [--calls 200000] [--loop]

Writes docs/results/policy_call_cost.json (docs/results.md, "Skipping where nothing pays").
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.policy import SKIPPED, CostModel, GoodputPolicy, TreeGoodputPolicy  # noqa: E402


def per_call_us(call, calls: int) -> float:
    """The least of 5 timings of `calls` calls, in µs per call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


@torch.no_grad()
def in_loop(rows: int = 8, settle: int = 3) -> dict:
    """Every drafts() call's seconds in one decode of 20 HumanEval prompts at `rows` rows in flight,
    sampled (T = 1, top-k 20, top-p 0.95), with the bench's adaptive 15-node tree policy (bfloat16
    products and drafter), settled over `settle` decodes first."""
    from dflash2 import load_embedded, spec_generate_batch
    from dflash2.decoding.batch import left_pad
    from dflash2.bench.methods import _Policies
    from dflash2.bench.prompts import load_prompts
    from dflash2.targets.static import StaticTarget

    tok, target, drafter = load_embedded()
    d = drafter.with_config(block_size=16).to(torch.bfloat16)
    ids, mask = left_pad([tok(t, return_tensors="pt").input_ids for t in load_prompts("humaneval", 20)[0]])
    step = StaticTarget(target, d.target_layer_ids, compile=True, linear_dtype="bfloat16")
    setting = dict(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=128)
    policy = _Policies(rows, padded=True, calibrators={})(step, d, setting, 15)
    decode = lambda seed: spec_generate_batch(d, step, ids, mask, verify="tree", tree_nodes=15,  # noqa: E731
                                              policy=policy, concurrency=rows,
                                              generator=torch.Generator().manual_seed(seed), **setting)
    for seed in range(settle):
        decode(seed)
    seconds, full, drafts, judge = [], [], policy.drafts, policy._drafts
    judged = [False]

    def judging(n: int) -> bool:
        judged[0] = True
        return judge(n)

    def timed(n: int) -> bool:
        judged[0] = False
        start = time.perf_counter()
        out = drafts(n)
        seconds.append(time.perf_counter() - start)
        full.append(judged[0])
        return out

    policy.drafts, policy._drafts = timed, judging
    start = time.perf_counter()
    decode(settle)
    total = time.perf_counter() - start
    found = dict(rows=rows, calls=len(seconds), share_of_decode=sum(seconds) / total, decode_s=total)
    for name, which in (("full", True), ("quiet", False)):
        us = sorted(s * 1e6 for s, f in zip(seconds, full) if f == which)
        found[name] = calls = dict(calls=len(us), median_us=us[len(us) // 2], p90_us=us[int(0.9 * len(us))]) if us else None
        if calls:
            print(f"in a decode at {rows} rows, {name} calls: {calls['calls']}, median {calls['median_us']:.1f} µs, "
                  f"90th percentile {calls['p90_us']:.1f} µs")
    print(f"every call together: {found['share_of_decode']:.2%} of the decode's {total:.2f} s")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--loop", action="store_true", help="also time the calls inside a decode at 8 rows (minutes)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" /
                   "policy_call_cost.json")
    args = p.parse_args()
    monitor = LoadMonitor()
    # plain steps of milliseconds, drafting priced at hours a round: every round skips, and no probe comes
    # (a probe waits until its price is a share of the seconds skipped)
    cost = CostModel(((1, 1e-3), (8, 2e-3), (32, 5e-3), (512, 5e-2)))
    rows_out = []
    empty = per_call_us(lambda: None, args.calls)
    for (kind, cls), rows, quiet in itertools.product((("path", GoodputPolicy), ("tree", TreeGoodputPolicy)), (1, 8, 32),
                                                  (True, False)):
        policy = cls(cost, 15, padded=rows > 1, draft_s={rows: 1e4}, loop_s={rows: 1e-4})
        if not quiet:
            policy.quiet_rounds = 0  # every call judges and times its round
        for _ in range(1000):  # settle: the residual windows filled, whether drafting pays cached
            if policy.drafts(rows):
                raise SystemExit("the policy drafted: the prices above should make every round skip")
        skipped = policy.chosen[SKIPPED]
        us = per_call_us(lambda: policy.drafts(rows), args.calls)
        if policy.chosen[SKIPPED] - skipped != 5 * args.calls * rows:
            raise SystemExit("the policy drafted while timed: its prices should make every round skip")
        rows_out.append(dict(policy=cls.__name__, verify=kind, rows=rows, quiet=quiet, us_per_call=us))
        print(f"{cls.__name__:<18} rows {rows:>2} {'quiet stretches' if quiet else 'every call full':<15}: "
              f"{us:.2f} µs per drafts() call (an empty call: {empty:.3f} µs)")
    loop = in_loop() if args.loop else None
    meta = dict(command="python experiments/policy_call_cost.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), calls=args.calls, empty_call_us=empty,
                load=monitor.record())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows_out, loop=loop), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
