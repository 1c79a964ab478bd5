"""The batched drafting round eager against compiled (drafter.compile: block pass, LM head, top-K and
the lattice as one graph, `DFlash2Drafter.draft_round_batch`), in one process, interleaved, beside
plain decoding through the same target step: N rows in flight (continuous batching), 7- and 15-node
trees and paths, the embedded pair, a compiled StaticTarget with bfloat16 products, a bfloat16
drafter, HumanEval prompts, 128 new tokens, greedy. Also the drafter's warm-up seconds, and whether
every output equals plain decoding's.

    python experiments/batch_drafting_ab.py [--rows 8] [--prompts 20] [--repetitions 3] [--out FILE]

Writes docs/results/batch_drafting_ab.json (docs/architecture.md, "Performance choices").
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash2 import load_embedded  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad, spec_generate_batch  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

KINDS = {"7-node trees": dict(verify="tree", tree_nodes=7), "15-node trees": dict(verify="tree", tree_nodes=15),
         "paths": dict(verify="path")}


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8, help="rows in flight")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "batch_drafting_ab.json")
    args = p.parse_args()
    if args.rows < 1 or args.prompts < 1 or args.repetitions < 1:
        p.error("--rows, --prompts and --repetitions must be positive")
    monitor = LoadMonitor()
    tok, target, drafter = load_embedded()
    eager = drafter.with_config(block_size=16).to(torch.bfloat16)
    texts, source = load_prompts("humaneval", args.prompts)
    batch, mask = left_pad([tok(t).input_ids for t in texts])
    kw = dict(max_new_tokens=128, concurrency=args.rows, stop_token_ids=[tok.eos_token_id])
    plain_step = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    spec_step = StaticTarget(target, eager.target_layer_ids, compile=True, linear_dtype="bfloat16")
    compiled = copy.deepcopy(eager)
    compiled.compile(dynamic=True)
    cases = {"plain": lambda: ar_generate_batch(plain_step, batch, mask, **kw)}
    for kind, verify in KINDS.items():
        for name, d in (("eager", eager), ("compiled", compiled)):
            cases[f"{kind}, {name}"] = lambda d=d, verify=verify: spec_generate_batch(d, spec_step, batch, mask,
                                                                                    **verify, **kw)
    warm = {}
    for case, fn in cases.items():  # the warm-ups (compiles) and first calls
        t = time.perf_counter()
        fn()
        warm[case] = round(time.perf_counter() - t, 1)
        print(f"warm-up {case}: {warm[case]:.0f} s", flush=True)
    runs: dict[str, list[float]] = {case: [] for case in cases}
    taus: dict[str, float] = {}
    outputs: dict[str, list] = {}
    for rep in range(args.repetitions):
        for case, fn in (cases.items() if rep % 2 == 0 else reversed(cases.items())):
            t = time.perf_counter()
            outs = fn()
            runs[case].append(sum(o.new_tokens.numel() for o in outs) / (time.perf_counter() - t))
            rounds = [n for o in outs for n in o.acceptance_lengths]
            taus[case] = sum(rounds) / len(rounds)
            outputs[case] = [o.new_tokens.tolist() for o in outs]
            print(f"rep {rep + 1} {case:<24} {runs[case][-1]:7.0f} tokens/s", flush=True)
    load = monitor.record()
    plain = statistics.median(runs["plain"])
    rows = []
    for case, speeds in runs.items():
        rows.append(dict(case=case, tokens_per_s=[round(x, 1) for x in speeds], tau=round(taus[case], 3),
                         vs_plain=round(statistics.median(speeds) / plain, 3),
                         same_outputs_as_plain=sum(a == b for a, b in zip(outputs[case], outputs["plain"])) / len(texts)))
        print(f"{case:<24} median {statistics.median(speeds):7.0f} tokens/s  τ {taus[case]:.2f}  "
              f"{rows[-1]['vs_plain']:.2f}× plain  same as plain {rows[-1]['same_outputs_as_plain']:.0%}")
    for kind in KINDS:
        e, c = (statistics.median(runs[f"{kind}, {n}"]) for n in ("eager", "compiled"))
        print(f"{kind}: compiled / eager {c / e:.2f}×")
    meta = dict(command="python experiments/batch_drafting_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                torch=torch.__version__, rows=args.rows, prompts=args.prompts, repetitions=args.repetitions,
                source=source, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, warm_up_s=warm, rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
