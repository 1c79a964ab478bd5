"""Which passes of StaticTarget's fused step to compile, measured interleaved in one process.

    python experiments/fused_step_ab.py [--out docs/results/fused_step_ab.json]

On the embedded pair (float32 target, 2 threads; run it quiet: nothing else running):
  * a one-token step at 300 cached positions, eager against compiled (the compiled graph called
    directly), medians of 200, the two alternating in 5 rounds;
  * whole decodes with 15-node trees (bfloat16 drafter, compiled backbone) on 10 HumanEval prompts
    × 2, verification eager (StaticTarget()) against compiled (StaticTarget(compile=True)), the
    order alternating per repetition; tokens/s by totals.
The load record is written beside the numbers; docs/architecture.md ("Performance choices") cites them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash2 import StaticTarget, spec_generate  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.embedded import load_embedded  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "fused_step_ab.json")
    args = parser.parse_args(argv)
    monitor = LoadMonitor()
    tokenizer, target, drafter = load_embedded("dflash2")

    # one-token steps: the same StaticTarget's step, eager and through its compiled graph
    fast = StaticTarget(target, compile=True)
    cache = fast.new_cache()
    with torch.no_grad():
        fast.forward(torch.randint(3, 4000, (1, 300), generator=torch.Generator().manual_seed(0)), cache, keep_logits=1)
        fast.forward(torch.tensor([[7, 8]]), cache)  # compiles the graphs (warm-up)
        fast.crop(cache, 300)
    ids, positions = torch.tensor([[7]]), torch.tensor([[300]])
    masks = fast._masks(positions[0], torch.arange(301), None)
    steps = {"eager": fast._step, "compiled": fast._runs["single"]}
    step_ms: dict[str, list[float]] = {k: [] for k in steps}
    with torch.no_grad():
        for _ in range(5):
            for name, step in steps.items():
                times = []
                for i in range(220):
                    t0 = time.perf_counter()
                    fast.head(step(ids, positions, masks, cache.keys, cache.values, 300)[0])
                    if i >= 20:
                        times.append(time.perf_counter() - t0)
                step_ms[name].append(1e3 * statistics.median(times))

    # whole tree decodes: verification eager against compiled
    prompts, _ = load_prompts("humaneval", 10)
    d = drafter.to(torch.bfloat16)
    d.backbone.compile(dynamic=True)
    variants = {"eager verify": StaticTarget(target, d.target_layer_ids),
                "compiled verify": StaticTarget(target, d.target_layer_ids, compile=True)}
    encoded = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    for tgt in variants.values():
        spec_generate(d, tgt, encoded[0], max_new_tokens=32, verify="tree", tree_nodes=15)
    totals = {k: [0, 0.0] for k in variants}
    for rep in range(2):
        for ids_ in encoded:
            for name, tgt in (list(variants.items()) if rep % 2 == 0 else list(variants.items())[::-1]):
                out = spec_generate(d, tgt, ids_, max_new_tokens=128, verify="tree", tree_nodes=15)
                totals[name][0] += out.new_tokens.numel()
                totals[name][1] += out.total_s
    result = dict(meta=dict(command="python experiments/fused_step_ab.py",
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cpu=cpu_description(),
                            load=monitor.record()),
                  one_token_step_ms={k: [round(v, 3) for v in vs] for k, vs in step_ms.items()},
                  tree15_tokens_per_s={k: round(n / s, 1) for k, (n, s) in totals.items()})
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}), result["meta"]["load"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
