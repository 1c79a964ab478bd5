"""What the adaptive 15-node tree row costs where it skips nearly every round, against plain decoding,
outside the bench: our plain decoding (`ar_generate` through a StaticTarget with bfloat16 products),
plain decoding through the step the adaptive row uses (it also returns the features a later draft
would read: what reading them costs), the speculative loop with a policy that never drafts (what
skipping costs with no probe at all: those features, the policy's call), the adaptive policy settled
(run over the prompt set twice first: its exploration spent, as on a server that has been running)
and fresh (as the bench's row starts a table: after one prompt). Interleaved per prompt (at more than
one row: per pass over the prompt set, `concurrency` rows in flight), the order reversed on odd
repetitions; the drafter in bfloat16; greedy, or T = 1, top-k 20, top-p 0.95. Each row's time per
token in the loop's stages (GenerationResult's prefill_s, draft_s, verify_s: before the first round,
drafting with the policy's call, verifying) says where a skipping row's extra time goes.

    python experiments/skip_path_ab.py [--concurrency 1] [--setting sampling] [--prompts 20] [--repetitions 3]

Writes docs/results/skip_path_ab.json at batch 1 with sampling (docs/results.md, "Skipping"), and
docs/results/skip_path_ab_<setting>_c<N>.json otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import ar_generate, ar_generate_batch, load_embedded, spec_generate, spec_generate_batch  # noqa: E402
from dflash2.decoding.batch import left_pad  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.methods import _Policies  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.decoding.loop import AutoregressiveDrafter  # noqa: E402
from dflash2.policy.cost import _NeverDraft  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="rows in flight (1: spec_generate, per prompt)")
    p.add_argument("--setting", choices=("greedy", "sampling"), default="sampling")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    default = (args.concurrency, args.setting) == (1, "sampling")
    out = args.out or results / ("skip_path_ab.json" if default else
                                 f"skip_path_ab_{args.setting}_c{args.concurrency}.json")
    monitor = LoadMonitor()  # from the start: the load before is the machine's, not this script's warm-up
    tok, target, drafter = load_embedded()
    d = drafter.with_config(block_size=16).to(torch.bfloat16)
    prompts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in prompts]
    plain_step = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    spec_step = StaticTarget(target, d.target_layer_ids, compile=True, linear_dtype="bfloat16")
    setting = dict(temperature=1.0, top_k=20, top_p=0.95) if args.setting == "sampling" else {}
    setting["max_new_tokens"] = 128
    c = args.concurrency
    policies = {name: _Policies(c, padded=c > 1, calibrators={})(spec_step, d, setting, 15)
                for name in ("settled", "fresh")}
    reader = AutoregressiveDrafter()  # plain decoding that reads the drafter's layers (the step's features)
    reader.target_layer_ids = tuple(d.target_layer_ids)
    if c == 1:  # a unit: one prompt
        units = [(x,) for x in ids]

        def plain(step, drafter=None):
            if drafter is not None:
                return lambda x, seed: spec_generate(drafter, step, *x, generator=torch.Generator().manual_seed(seed),
                                                     **setting)
            return lambda x, seed: ar_generate(step, *x, generator=torch.Generator().manual_seed(seed), **setting)

        def spec(policy):
            return lambda x, seed: spec_generate(d, spec_step, *x, verify="tree", tree_nodes=15, policy=policy,
                                                 generator=torch.Generator().manual_seed(seed), **setting)
    else:  # a unit: the whole prompt set, c rows in flight
        units = [left_pad(ids)]

        def plain(step, drafter=None):
            if drafter is not None:
                return lambda x, seed: spec_generate_batch(drafter, step, *x, concurrency=c,
                                                           generator=torch.Generator().manual_seed(seed), **setting)
            return lambda x, seed: ar_generate_batch(step, *x, generator=torch.Generator().manual_seed(seed),
                                                     concurrency=c, **setting)

        def spec(policy):
            return lambda x, seed: spec_generate_batch(d, spec_step, *x, verify="tree", tree_nodes=15, policy=policy,
                                                       generator=torch.Generator().manual_seed(seed),
                                                       concurrency=c, **setting)

    rows = {"plain": plain(plain_step), "plain, feature step": plain(spec_step, reader),
            "never drafts": spec(_NeverDraft()),
            "settled": spec(policies["settled"]), "fresh": spec(policies["fresh"])}
    for _ in range(2):
        for i, x in enumerate(units):
            rows["settled"](x, i)
    for fn in rows.values():  # compiles, first calls; the fresh policy's one unit, as the bench's warm-up
        fn(units[0], 0)
    before = {name: policy.chosen.copy() for name, policy in policies.items()}
    totals = {name: [0, 0.0] for name in rows}
    per_rep = {name: [] for name in rows}  # each repetition's tokens/s
    # each row's seconds in the loop's stages (a batch's results share its timings: counted once)
    stages = {name: dict(prefill=0.0, draft=0.0, verify=0.0) for name in rows}
    for rep in range(args.repetitions):
        done = {name: [0, 0.0] for name in rows}
        for i, x in enumerate(units):
            # the rows' order reversed on odd repetitions (ABBA): a row's place after another, and the machine's
            # drift over a repetition, favour no row
            for name, fn in (list(rows.items()) if rep % 2 == 0 else list(rows.items())[::-1]):
                t = time.perf_counter()
                result = fn(x, 1000 * rep + i)
                done[name][1] += time.perf_counter() - t
                outs = result if isinstance(result, list) else [result]
                done[name][0] += sum(o.new_tokens.numel() for o in outs)
                for stage in stages[name]:
                    stages[name][stage] += getattr(outs[0], f"{stage}_s")
        for name, (n, s) in done.items():
            totals[name][0] += n
            totals[name][1] += s
            per_rep[name].append(n / s)
    load = monitor.record()
    plain = totals["plain"][0] / totals["plain"][1]
    table = []
    print(f"{'row':<20} {'tokens/s':>9} {'/ plain':>8}  drafted rounds in the timed runs")
    for name, (n, s) in totals.items():
        chosen = policies[name].chosen - before[name] if name in policies else None
        drafted = None if chosen is None else sum(v for w, v in chosen.items() if w >= 0)
        table.append(dict(row=name, tokens_per_s=n / s, ratio=n / s / plain, drafted=drafted,
                          rounds=None if chosen is None else sum(chosen.values()),
                          per_repetition=per_rep[name],
                          stages_us_per_token={k: 1e6 * v / n for k, v in stages[name].items()}))
        counted = "" if chosen is None else f"{drafted} of {table[-1]['rounds']}"
        print(f"{name:<20} {n / s:>9.1f} {n / s / plain:>7.3f}×  {counted}")
    meta = dict(command="python experiments/skip_path_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                prompts=args.prompts, repetitions=args.repetitions, concurrency=c, setting=args.setting,
                source=source, load=load)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=table), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
