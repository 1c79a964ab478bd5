"""What the adaptive 15-node tree row costs at batch 1 with sampling, where it skips nearly every round,
against plain decoding, outside the bench: our plain decoding (`ar_generate` through a StaticTarget
with bfloat16 products), the speculative loop with a policy that never drafts (what skipping costs
with no probe at all: the features a later draft would read, the policy's call), the adaptive policy
settled (run over the prompt set twice first: its exploration spent, as on a server that has been
running) and fresh (as the bench's row starts a table: after one prompt). Interleaved per prompt,
the drafter in bfloat16, T = 1, top-k 20, top-p 0.95.

    python experiments/skip_path_ab.py [--prompts 20] [--repetitions 3]

Writes docs/results/skip_path_ab.json (docs/results.md, "Skipping at batch 1 with sampling").
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

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.methods import _Policies  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.policy import _NeverDraft  # noqa: E402
from dflash2.target.static import StaticTarget  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" / "skip_path_ab.json")
    args = p.parse_args()
    monitor = LoadMonitor()  # from the start: the load before is the machine's, not this script's warm-up
    tok, target, drafter = load_embedded()
    d = drafter.with_config(block_size=16).to(torch.bfloat16)
    prompts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in prompts]
    plain_step = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    spec_step = StaticTarget(target, d.target_layer_ids, compile=True, linear_dtype="bfloat16")
    sampling = dict(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=128)
    policies = {name: _Policies(1, padded=False, calibrators={})(spec_step, d, sampling, 15)
                for name in ("settled", "fresh")}

    def spec(policy):
        return lambda x, seed: spec_generate(d, spec_step, x, verify="tree", tree_nodes=15, policy=policy,
                                             generator=torch.Generator().manual_seed(seed), **sampling)

    rows = {"plain": lambda x, seed: ar_generate(plain_step, x, generator=torch.Generator().manual_seed(seed),
                                                 **sampling),
            "never drafts": spec(_NeverDraft()), "settled": spec(policies["settled"]), "fresh": spec(policies["fresh"])}
    for _ in range(2):
        for i, x in enumerate(ids):
            rows["settled"](x, i)
    for fn in rows.values():  # compiles, first calls; the fresh policy's one prompt, as the bench's warm-up
        fn(ids[0], 0)
    before = {name: policy.chosen.copy() for name, policy in policies.items()}
    totals = {name: [0, 0.0] for name in rows}
    for rep in range(args.repetitions):
        for i, x in enumerate(ids):
            for name, fn in rows.items():
                t = time.perf_counter()
                out = fn(x, 1000 * rep + i)
                totals[name][1] += time.perf_counter() - t
                totals[name][0] += out.new_tokens.numel()
    load = monitor.record()
    plain = totals["plain"][0] / totals["plain"][1]
    table = []
    print(f"{'row':<14} {'tokens/s':>9} {'/ plain':>8}  drafted rounds in the timed runs")
    for name, (n, s) in totals.items():
        chosen = policies[name].chosen - before[name] if name in policies else None
        drafted = None if chosen is None else sum(v for w, v in chosen.items() if w >= 0)
        table.append(dict(row=name, tokens_per_s=n / s, ratio=n / s / plain, drafted=drafted,
                          rounds=None if chosen is None else sum(chosen.values())))
        counted = "" if chosen is None else f"{drafted} of {table[-1]['rounds']}"
        print(f"{name:<14} {n / s:>9.1f} {n / s / plain:>7.3f}×  {counted}")
    meta = dict(command="python experiments/skip_path_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                prompts=args.prompts, repetitions=args.repetitions, source=source, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=table), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
