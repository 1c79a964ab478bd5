"""Does inductor's weight freezing speed up the compiled StaticTarget step? Plain decoding (128 new
tokens, 6 HumanEval prompts x 2, embedded target, float32, 2 threads), each variant in its own process,
alternating, 3 processes per variant:

    python experiments/static_freezing.py --out docs/results/static_freezing.json

"plain": StaticTarget(compile=True) as shipped; "freezing": the same with
torch._inductor.config.freezing = True (weights as constants, oneDNN-prepacked linear layers).
Each process checks its greedy output against the model's own forward first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import sys, time, torch
if sys.argv[1] == "freezing":
    import torch._inductor.config as inductor_config
    inductor_config.freezing = True
from dflash2 import StaticTarget, ar_generate
from dflash2.embedded import load_embedded
from dflash2.bench.prompts import load_prompts
torch.set_num_threads(2)
tok, target, _ = load_embedded("dflash2")
fast = StaticTarget(target, (), compile=True)
ids = [tok(t, return_tensors="pt").input_ids for t in load_prompts("humaneval", 6)[0]]
with torch.no_grad():
    ar_generate(fast, ids[0], max_new_tokens=16)  # compiles
    assert torch.equal(ar_generate(fast, ids[1], max_new_tokens=32).sequences,
                       ar_generate(target, ids[1], max_new_tokens=32).sequences)
    tokens = seconds = 0
    for _ in range(2):
        for i in ids:
            start = time.perf_counter()
            tokens += ar_generate(fast, i, max_new_tokens=128).new_tokens.numel()
            seconds += time.perf_counter() - start
print(tokens / seconds)
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--processes", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from dflash2.bench.machine import LoadMonitor

    monitor, runs = LoadMonitor(), []
    for rep in range(args.processes):
        for variant in ("plain", "freezing"):
            out = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True, cwd=ROOT,
                                 check=True)
            runs.append(dict(variant=variant, process=rep, tokens_per_s=float(out.stdout.strip().splitlines()[-1])))
            print(json.dumps(runs[-1]), flush=True)
    record = dict(date=time.strftime("%Y-%m-%d"), runs=runs, **monitor.record())
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
