"""Where a batched speculative round's time goes, against the plain step it has to beat: the embedded
pair at 8 rows in flight (HumanEval, greedy, 128 new tokens, continuous batching), a fixed-size tree
per row, every stage timed inside whole decodes.

    python experiments/performance/batch_round_stages.py [--rows 8] [--nodes 7] [--repeats 3] [--compiled]

Plain decoding (`ar_generate_batch`) and tree decoding (`spec_generate_batch(verify="tree")`) alternate,
`--repeats` times each, through one StaticTarget step (bfloat16 products by default, as the regimes
table's fastest plain rows) and a bfloat16 drafter. The stages are the loop's own calls, wrapped with
a timer (a microsecond each): the drafter's context extension, block pass with LM head and top-K, the
selector's lattice and the per-row trees; the target's pass, the per-row verdicts, the cache's
bookkeeping. Reported per round (a round: one drafting pass for every row in flight), with the
round time at which speculation would tie plain decoding (τ rows' tokens at the plain step's
tokens per second) and beat it by 1.3×. Writes docs/results/batch_round_stages.json.
"""

from __future__ import annotations

import argparse
import collections
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

import dflash2.decoding.batch as batch  # noqa: E402
import dflash2.drafter as drafter_module  # noqa: E402
from dflash2 import load_embedded  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad, spec_generate_batch  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

# label → (owner attribute path, function name); nested labels are parts of the one above them
STAGES = [
    ("drafting (propose_tree_batch)", "drafter", "propose_tree_batch"),
    ("  context extension (extend_batch)", "backbone", "extend_batch"),
    ("  block pass, LM head, top-K, lattice (draft_round_batch)", "drafter", "draft_round_batch"),
    ("    selector lattice", "selector", "lattice"),
    ("  best-first trees, per row", "drafter_module", "best_first_tree"),
    ("verification (_verify_and_commit)", "batch", "_verify_and_commit"),
    ("  target pass (forward_masked)", "target", "forward_masked"),
    ("  per-row verdicts (decide)", "batch", "decide"),
    ("  cache bookkeeping (keep_block)", "target", "keep_block"),
    ("finished rows and compaction (_retire)", "batch", "_retire"),
    ("newcomers' prefill (_admit)", "batch", "_admit"),
]
INSIDE = {"  target pass (forward_masked)": "verification (_verify_and_commit)"}  # counted only within


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--nodes", type=int, default=7)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--linear-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--drafter-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--compiled", action="store_true",
                   help="the drafter's batched round compiled (drafter.compile); its lattice is then inside the graph")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "batch_round_stages.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tok, target, drafter = load_embedded("dflash2")
    target, drafter = target.float(), drafter.to(getattr(torch, args.drafter_dtype))
    texts, source = load_prompts("humaneval", args.prompts)
    ids, mask = left_pad([tok(t).input_ids for t in texts])
    linear = None if args.linear_dtype == "float32" else args.linear_dtype
    step = StaticTarget(target, tuple(drafter.target_layer_ids), compile=True, linear_dtype=linear)
    plain_step = StaticTarget(target, (), compile=True, linear_dtype=linear)
    kw = dict(max_new_tokens=128, concurrency=args.rows, stop_token_ids=[tok.eos_token_id])
    if args.compiled:
        drafter.compile(dynamic=True)

    owners = dict(drafter=drafter, backbone=drafter.backbone, selector=drafter.candidate_selector,
                  drafter_module=drafter_module, batch=batch, target=step)
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    active: collections.Counter = collections.Counter()  # stages in progress
    def timer(f, label):
        def timed(*a, **k):
            if label in INSIDE and not active[INSIDE[label]]:
                return f(*a, **k)
            active[label] += 1
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1
                active[label] -= 1
        return timed

    for label, owner, name in STAGES:
        if args.compiled and owner == "selector":  # inside the compiled graph: not timed apart
            continue
        setattr(owners[owner], name, timer(getattr(owners[owner], name), label))

    def plain():
        return ar_generate_batch(plain_step, ids, mask, **kw)

    def tree():
        return spec_generate_batch(drafter, step, ids, mask, verify="tree", tree_nodes=args.nodes, **kw)

    runs: dict[str, list[dict]] = {"plain": [], "tree": []}
    with torch.no_grad():
        plain(), tree()  # warm-up: compiled graphs, oneDNN's shapes
        monitor = LoadMonitor()
        for _ in range(args.repeats):
            for name, fn in (("plain", plain), ("tree", tree)):  # interleaved
                seconds.clear(), calls.clear()
                start = time.perf_counter()
                outs = fn()
                total = time.perf_counter() - start
                tokens = sum(o.new_tokens.numel() for o in outs)
                steps = sum(len(o.acceptance_lengths) for o in outs)
                # rounds: one per drafting pass over the rows in flight (plain: one per batched step)
                rounds = calls["drafting (propose_tree_batch)"] if name == "tree" else \
                    calls["finished rows and compaction (_retire)"]  # (the plain loop drafts nothing)
                runs[name].append(dict(tokens=tokens, seconds=total, rounds=rounds, tau=tokens / steps,
                                       stages_ms={k: 1e3 * v / max(rounds, 1) for k, v in seconds.items()}))
        load = monitor.record()

    med = lambda xs: statistics.median(xs)  # noqa: E731
    plain_tps = med([r["tokens"] / r["seconds"] for r in runs["plain"]])
    tree_tps = med([r["tokens"] / r["seconds"] for r in runs["tree"]])
    plain_round = med([1e3 * r["seconds"] / r["rounds"] for r in runs["plain"]])
    tree_round = med([1e3 * r["seconds"] / r["rounds"] for r in runs["tree"]])
    tau = med([r["tau"] for r in runs["tree"]])
    per_round = tree_tps * tree_round / 1e3  # tokens a round commits, all rows together
    stages = {label: med([r["stages_ms"].get(label, 0.0) for r in runs["tree"]]) for label, *_ in STAGES}
    summary = dict(plain_tokens_per_s=plain_tps, tree_tokens_per_s=tree_tps, ratio=tree_tps / plain_tps,
                   plain_step_ms=plain_round, tree_round_ms=tree_round, tau=tau, tokens_per_round=per_round,
                   tie_round_ms=1e3 * per_round / plain_tps, round_ms_for_1_3x=1e3 * per_round / plain_tps / 1.3,
                   stages_ms=stages)
    meta = dict(command="python experiments/performance/batch_round_stages.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=args.threads, rows=args.rows,
                nodes=args.nodes, source=source, linear_dtype=args.linear_dtype, drafter_dtype=args.drafter_dtype,
                repeats=args.repeats, compiled_drafter=args.compiled, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, summary=summary, runs=runs), indent=2) + "\n")
    print(f"plain {plain_tps:.0f} tokens/s ({plain_round:.2f} ms a step); tree{args.nodes} {tree_tps:.0f} tokens/s "
          f"({tree_round:.2f} ms a round, τ {tau:.2f}, {per_round:.1f} tokens a round): {tree_tps / plain_tps:.2f}×")
    print(f"a round ties plain decoding at {summary['tie_round_ms']:.2f} ms and beats it 1.3× at "
          f"{summary['round_ms_for_1_3x']:.2f} ms\n")
    print("| stage | ms per round |\n|---|---|")
    for label, ms in stages.items():
        print(f"| {label.strip() if not label.startswith(' ') else '… ' + label.strip()} | {ms:.2f} |")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
