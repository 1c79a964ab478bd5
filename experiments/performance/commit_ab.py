"""Whole decodes on the embedded pair at two commits, each run in a fresh process, the commits
alternating (their order swapped every repetition): what a change of the loop, the target's step or
the drafter did to speed, with nothing else moving.

    python experiments/performance/commit_ab.py BEFORE AFTER [--cases plain1,tree1,plain8,tree8,plain32] [--repetitions 3]

BEFORE and AFTER are anything `git worktree add` takes (commits, branches; AFTER may be `.` for the
working tree as it is). Each is checked out once into a temporary worktree; a worker process imports
dflash2 from it, decodes the case once to warm up (compiled graphs, oneDNN's shapes), then times one
decode. Cases (HumanEval, greedy, 128 new tokens, targets through a compiled StaticTarget with
bfloat16 products, the drafter in bfloat16, as the regimes table's rows):

    plain1   plain decoding, batch 1 (the first --single prompts one at a time)
    tree1    DFlash-2, a 15-node tree, batch 1, the drafter's round compiled
    plainN   plain decoding, N rows in flight (continuous batching over --prompts prompts)
    treeN    DFlash-2, a 7-node tree per row, N rows in flight, the drafter eager
    ctreeN   the same with the drafter's rounds compiled (drafter.compile)

Prints tokens/s per case and commit, and whether the outputs are identical; writes --out (JSON).
Time it on a quiet machine (../shared/tools/quiet, or `uptime` well under 1).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(repo: Path, case: str, prompts: int, single: int) -> dict:
    sys.path.insert(0, str(repo))
    import torch

    from dflash2 import ar_generate, load_embedded, spec_generate
    from dflash2.decoding.batch import ar_generate_batch, left_pad, spec_generate_batch
    from dflash2.bench.prompts import load_prompts
    from dflash2.targets.static import StaticTarget

    tok, target, drafter = load_embedded("dflash2")
    target, drafter = target.float(), drafter.to(torch.bfloat16)
    texts, _ = load_prompts("humaneval", prompts)
    eos = [tok.eos_token_id]
    kind, rows = re.fullmatch(r"(plain|c?tree)(\d+)", case).groups()
    rows = int(rows)
    layers = () if kind == "plain" else tuple(drafter.target_layer_ids)
    step = StaticTarget(target, layers, compile=True, linear_dtype="bfloat16")
    if rows == 1:
        singles = [tok(t, return_tensors="pt").input_ids for t in texts[:single]]
        if kind != "plain":
            drafter.compile(dynamic=True)

        def decode():
            if kind == "plain":
                return [ar_generate(step, ids, max_new_tokens=128, stop_token_ids=eos) for ids in singles]
            return [spec_generate(drafter, step, ids, max_new_tokens=128, stop_token_ids=eos, verify="tree",
                                  tree_nodes=15) for ids in singles]
    else:
        ids, mask = left_pad([tok(t).input_ids for t in texts])
        kw = dict(max_new_tokens=128, concurrency=rows, stop_token_ids=eos)
        if kind == "ctree":
            drafter.compile(dynamic=True)

        def decode():
            if kind == "plain":
                return ar_generate_batch(step, ids, mask, **kw)
            return spec_generate_batch(drafter, step, ids, mask, verify="tree", tree_nodes=7, **kw)

    with torch.no_grad():
        decode()  # warm-up
        start = time.perf_counter()
        outs = decode()
        seconds = time.perf_counter() - start
    tokens = sum(o.new_tokens.numel() for o in outs)
    digest = hashlib.sha256(json.dumps([o.sequences[0].tolist() for o in outs]).encode()).hexdigest()[:16]
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, outputs=digest)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", nargs="?")
    p.add_argument("after", nargs="?")
    p.add_argument("--cases", default="plain1,tree1,plain8,tree8,plain32")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--prompts", type=int, default=20, help="prompts of the batched cases")
    p.add_argument("--single", type=int, default=10, help="prompts of the batch-1 cases")
    p.add_argument("--out", type=Path, default=None, help="JSON to write (default: print only)")
    p.add_argument("--worker", nargs=2, metavar=("REPO", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.worker[0]), args.worker[1], args.prompts, args.single)))
        return 0
    if args.before is None or args.after is None:
        p.error("give the two commits to compare: BEFORE AFTER")
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if not re.fullmatch(r"(plain|c?tree)[1-9]\d*", c)]
    if bad:
        p.error(f"unknown cases {bad}: plain<N>, tree<N> or ctree<N>, N rows in flight (e.g. plain1, ctree8)")
    sys.path.insert(0, str(ROOT))
    from dflash2.bench.machine import LoadMonitor

    monitor = LoadMonitor()
    with tempfile.TemporaryDirectory(prefix="commit_ab_") as tmp:
        trees = {}
        for name, ref in (("before", args.before), ("after", args.after)):
            if ref == ".":
                trees[name], trees[name + "_commit"] = ROOT, "working tree"
                continue
            path = Path(tmp) / name
            done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), ref],
                                  capture_output=True, text=True)
            if done.returncode:
                print(f"error: cannot check out {ref!r}: {done.stderr.strip()}", file=sys.stderr)
                return 2
            trees[name] = path
            trees[name + "_commit"] = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                                                     capture_output=True, text=True).stdout.strip()
        runs: dict[str, dict[str, list[dict]]] = {c: {"before": [], "after": []} for c in cases}
        try:
            for rep in range(args.repetitions):
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                for case in cases:
                    for name in order:
                        cmd = [sys.executable, __file__, "--worker", str(trees[name]), case,
                               "--prompts", str(args.prompts), "--single", str(args.single)]
                        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                        if done.returncode:
                            print(f"error: {case} at {name} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                            return 1
                        run = json.loads(done.stdout.strip().splitlines()[-1])
                        runs[case][name].append(run)
                        print(f"rep {rep + 1} {case:8s} {name:6s} {run['tokens_per_s']:8.1f} tokens/s", flush=True)
        finally:
            for name in ("before", "after"):
                if trees[name] != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[name])],
                                   capture_output=True)
    load = monitor.record()
    summary = {}
    for case, r in runs.items():
        b = [x["tokens_per_s"] for x in r["before"]]
        a = [x["tokens_per_s"] for x in r["after"]]
        same = {x["outputs"] for x in r["before"]} == {x["outputs"] for x in r["after"]}
        summary[case] = dict(before=[round(x, 1) for x in b], after=[round(x, 1) for x in a],
                             ratio_of_medians=round(statistics.median(a) / statistics.median(b), 3),
                             identical_outputs=same)
        print(f"{case:8s} before {', '.join(f'{x:.0f}' for x in b)}  after {', '.join(f'{x:.0f}' for x in a)}  "
              f"→ {summary[case]['ratio_of_medians']:.3f}× (outputs {'identical' if same else 'differ'})")
    print(f"load: {load}")
    if args.out:
        meta = dict(command="python experiments/performance/commit_ab.py " + " ".join(sys.argv[1:]),
                    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    machine=platform.platform(), before=trees["before_commit"], after=trees["after_commit"],
                    load=load)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
