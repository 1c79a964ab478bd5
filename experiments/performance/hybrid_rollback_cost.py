"""What exact rollback costs on a hybrid target, per round, against the verify forward itself.

    python experiments/performance/hybrid_rollback_cost.py [--rounds 30] [--block 16]

A random Qwen3.5-style target (hidden 256, 8 layers, 3 of 4 linear attention; float32, CPU) decodes
with an oracle drafter whose every 3rd token is wrong, so most rounds are partial. Each round times
the verify forward, the state snapshot taken before it, and the restore + replay after it; the
alternative of snapshotting by deep-copying the whole cache (K/V included) is timed beside it.
Prints a markdown table; docs/hybrid-targets.md quotes it with machine and date.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash2 import TargetAdapter  # noqa: E402
from dflash2.targets.adapter import _snapshot  # noqa: E402


def main() -> int:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    adapter = TargetAdapter(model)
    cache = adapter.new_cache()
    ids = torch.randint(0, 4096, (1, args.context))
    adapter.forward(ids, cache)
    times = {"verify": [], "snapshot": [], "restore_replay": [], "deepcopy_cache": []}
    accepted = []
    g = torch.Generator().manual_seed(1)
    for r in range(args.rounds):
        block = torch.randint(0, 4096, (1, args.block), generator=g)
        t0 = time.perf_counter()
        _snapshot(cache)
        t1 = time.perf_counter()
        copy.deepcopy(cache)
        t2 = time.perf_counter()
        step = adapter.forward(block, cache)  # takes its own snapshot too: subtract it
        t3 = time.perf_counter()
        keep = 1 + (r * 7) % (args.block - 1)  # partial acceptance, spread over 1..B-1
        adapter.rollback(cache, step, keep)
        t4 = time.perf_counter()
        times["snapshot"].append(t1 - t0)
        times["deepcopy_cache"].append(t2 - t1)
        times["verify"].append(t3 - t2 - (t1 - t0))
        times["restore_replay"].append(t4 - t3)
        accepted.append(keep)
    verify = statistics.median(times["verify"])
    print(f"{platform.platform()}, {torch.get_num_threads()} threads, context {args.context}, block {args.block}, "
          f"{args.rounds} rounds, median kept {statistics.median(accepted)} tokens\n")
    print("| per round | median ms | × verify |\n|---|---|---|")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"| {name} | {m * 1e3:.2f} | {m / verify:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
