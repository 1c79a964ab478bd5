"""Where a decoding step's time goes against the machine's limits, for the embedded target.

    python experiments/performance/roofline.py [--out docs/results/roofline.json]

Measures on this machine (run it quiet: nothing else running):
  * memory read bandwidth: a sum over 256 MB of float32 (torch, this process's threads);
  * matmul throughput: the target's own linear layers run back to back for n tokens (n = 1 ... 128),
    i.e. every weight matrix read once per pass, as a forward pass reads them; through F.linear (the
    model's forward) and through the oneDNN-prepacked weights of StaticTarget's fused step;
  * whole target passes: the model's forward (TargetAdapter) and StaticTarget (its model's layers
    compiled; the fused step, eager and with multi-token passes compiled) at batch 1,
    one token and 16 tokens, and batches of 8 rows (the model's forward) with 1 and 16 tokens per row.
and sets each against its floor: max(weight bytes / bandwidth, FLOPs / the best matmul throughput).
docs/results.md shows the table (experiments/embedded/report.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash2 import StaticTarget, TargetAdapter
from dflash2.targets.fused import Linear
from dflash2.embedded import load_embedded


def timed(fn, repeat: int = 30, warm: int = 5) -> float:
    """Median seconds of fn()."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/roofline.json"))
    parser.add_argument("--context", type=int, default=300, help="cached positions before each measured pass")
    args = parser.parse_args(argv)
    from dflash2.bench.config import cpu_description
    from dflash2.bench.machine import LoadMonitor

    torch.set_grad_enabled(False)
    monitor = LoadMonitor()
    _, target, drafter = load_embedded("dflash2")
    big = torch.ones(64 * 1024 * 1024)  # 256 MB
    bandwidth = big.numel() * 4 / timed(big.sum, repeat=10)
    del big
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    params = sum(m.weight.numel() for m in linears)  # multiply-adds per token
    packed = [Linear(m.weight, m.bias) for m in linears]  # what StaticTarget's fused step multiplies with
    matmul, matmul_packed = {}, {}
    for n in (1, 8, 16, 64, 128):
        xs = {m.in_features: torch.randn(n, m.in_features) for m in linears}
        seconds = timed(lambda: [m(xs[m.in_features]) for m in linears])
        matmul[n] = {"seconds": seconds, "gflops": 2 * params * n / seconds / 1e9}
        seconds = timed(lambda: [p(xs[p.weight.shape[1]]) for p in packed])
        matmul_packed[n] = {"seconds": seconds, "gflops": 2 * params * n / seconds / 1e9}
    peak = max(v["gflops"] for v in (*matmul.values(), *matmul_packed.values())) * 1e9

    def floor(tokens: int) -> float:
        return max(weight_bytes / bandwidth, 2 * params * tokens / peak)

    g = torch.Generator().manual_seed(0)
    context = torch.randint(3, 4000, (1, args.context), generator=g)
    passes = []
    layers = drafter.target_layer_ids
    for name, adapter in (("model forward (TargetAdapter)", TargetAdapter(target, layers)),
                          ("StaticTarget, the model's layers, compiled",
                           StaticTarget(target, layers, compile=True, fused=False)),
                          ("StaticTarget, fused, eager", StaticTarget(target, layers)),
                          ("StaticTarget, fused (multi-token passes compiled)", StaticTarget(target, layers, compile=True))):
        cache = adapter.new_cache()
        adapter.forward(context, cache, keep_logits=1)
        for tokens in (1, 16):
            block = torch.randint(3, 4000, (1, tokens), generator=g)

            def one_pass():
                step = adapter.forward(block, cache)
                adapter.rollback(cache, step, 0)
            passes.append(dict(path=name, rows=1, tokens=tokens, seconds=timed(one_pass), floor=floor(tokens)))
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    rows = 8
    for tokens in (1, 16):
        cache = adapter.new_cache()
        adapter.model(input_ids=context.expand(rows, -1), use_cache=True, **{adapter._cache_kw: cache})
        block = torch.randint(3, 4000, (rows, tokens), generator=g)

        def batch_pass():
            adapter.model(input_ids=block, use_cache=True, output_hidden_states=True, **{adapter._cache_kw: cache})
            adapter.crop(cache, args.context)
        passes.append(dict(path="model forward, batch", rows=rows, tokens=tokens, seconds=timed(batch_pass),
                           floor=floor(rows * tokens)))
    result = dict(meta=dict(command="python experiments/performance/roofline.py",
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            machine=platform.platform(), cpu=cpu_description(), context=args.context,
                            load=monitor.record()),
                  bandwidth_gb_s=bandwidth / 1e9, weight_mb=weight_bytes / 1e6, macs_per_token=params,
                  matmul=matmul, matmul_packed=matmul_packed, passes=passes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s; weights {weight_bytes / 1e6:.1f} MB; best matmul {peak / 1e9:.0f} GFLOP/s")
    for p in passes:
        print(f"{p['path']:32s} rows {p['rows']} tokens {p['tokens']:3d}: {1e3 * p['seconds']:.2f} ms "
              f"(floor {1e3 * p['floor']:.2f} ms)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
