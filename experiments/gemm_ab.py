"""Who writes the compiled products: StaticTarget(gemm="inductor") and drafter.compile(gemm="inductor")
(the weights frozen into the graphs, inductor's C++ GEMM kernels) against gemm="aten" (the prepacked
oneDNN call, the drafter's nn.Linear), in one process, interleaved: plain decoding at 1, 8 and 32 rows
in flight and the 15-node tree at batch 1 (compiled drafting round), the embedded pair, bfloat16
products and a bfloat16 drafter, HumanEval prompts, 128 new tokens, greedy. Also each choice's
warm-up seconds (StaticTarget's batch-1 and batch graphs, the drafter's round) and the process's peak
memory after it.

    python experiments/gemm_ab.py [--prompts 20] [--repetitions 3] [--out FILE]

Writes docs/results/gemm_ab.json (docs/architecture.md, "Performance choices").
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402

GEMMS = ("aten", "inductor")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "gemm_ab.json")
    args = p.parse_args()
    monitor = LoadMonitor()
    tok, target, drafter = load_embedded()
    d0 = drafter.with_config(block_size=16).to(torch.bfloat16)
    texts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in texts]
    batch, mask = left_pad([x[0] for x in ids])
    cases = {}
    warm = {}
    for gemm in GEMMS:
        t, before = time.perf_counter(), peak_mb()
        plain = StaticTarget(target, (), compile=True, linear_dtype="bfloat16", gemm=gemm)
        spec = StaticTarget(target, d0.target_layer_ids, compile=True, linear_dtype="bfloat16", gemm=gemm)
        d = copy.deepcopy(d0)
        d.compile(dynamic=True, gemm=gemm)
        cases[("plain, batch 1", gemm)] = lambda x, plain=plain: [ar_generate(plain, x, max_new_tokens=128)]
        cases[("15-node tree, batch 1", gemm)] = lambda x, spec=spec, d=d: [
            spec_generate(d, spec, x, verify="tree", tree_nodes=15, max_new_tokens=128)]
        for rows in (8, 32):
            cases[(f"plain, {rows} rows", gemm)] = lambda _, plain=plain, rows=rows: ar_generate_batch(
                plain, batch, mask, max_new_tokens=128, concurrency=rows)
        for (case, g), fn in cases.items():  # the warm-ups (compiles) and first calls
            if g == gemm:
                fn(ids[0])
        warm[gemm] = dict(seconds=time.perf_counter() - t, peak_mb_before=before, peak_mb_after=peak_mb())
        print(f"{gemm}: warm-up {warm[gemm]['seconds']:.0f} s, peak memory {before:.0f} → {peak_mb():.0f} MB", flush=True)
    runs: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.repetitions):
        for case in dict.fromkeys(c for c, _ in cases):
            for gemm in GEMMS:
                fn = cases[(case, gemm)]
                n, t = 0, time.perf_counter()
                prompts = ids if "batch 1" in case else ids[:1]  # a batched case decodes every prompt in one call
                for x in prompts:
                    n += sum(r.new_tokens.numel() for r in fn(x))
                runs[(case, gemm)].append(n / (time.perf_counter() - t))
    load = monitor.record()
    rows = []
    for case in dict.fromkeys(c for c, _ in cases):
        aten, ind = (statistics.median(runs[(case, g)]) for g in GEMMS)
        rows.append(dict(case=case, aten=runs[(case, "aten")], inductor=runs[(case, "inductor")], ratio=ind / aten))
        print(f"{case:<24} aten {aten:7.0f}  inductor {ind:7.0f} tokens/s  {ind / aten:.2f}×")
    meta = dict(command="python experiments/gemm_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                torch=torch.__version__, prompts=args.prompts, repetitions=args.repetitions, source=source, load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, warm_up=warm, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
