"""Batch-1 decoding with StaticTarget's cache buffers as they were allocated before, at the whole
capacity on a cache's first pass, against the package's, grown as the decode needs them. One process,
one compiled StaticTarget with bfloat16 products (its graphs serve both: the slot dimension is
dynamic), the earlier allocation swapped in by patching; plain decoding, greedy and sampled (T = 1,
top-k 20, top-p 0.95), HumanEval prompts, 128 new tokens, interleaved per prompt, the order reversed
on odd repetitions. Each decode's time before its first round (GenerationResult.prefill_s) holds the
allocation.

    capacity  the buffers [1, kv_heads, capacity, hd] per layer, zeroed, on the first pass
    grown     the package: twice the first pass's slots, doubled when a pass fills them

    python experiments/cache_alloc_ab.py [--prompts 20] [--repetitions 4]

Writes docs/results/cache_alloc_ab.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import ar_generate, load_embedded  # noqa: E402
from dflash2.bench.config import cpu_description  # noqa: E402
from dflash2.bench.machine import LoadMonitor  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402
from dflash2.targets.static import StaticCache, StaticTarget  # noqa: E402


def reserve_capacity(self: StaticTarget, cache: StaticCache, slots: int) -> None:
    """StaticTarget._reserve before the buffers grew: the whole capacity on a cache's first pass."""
    if slots > self.capacity:
        raise ValueError(f"the sequence needs {slots} cache slots; this StaticTarget holds {self.capacity}")
    if cache.keys:
        return
    attn = self.decoder.layers[0].self_attn
    kv_heads = getattr(attn, "num_key_value_heads", None) or self.config.num_key_value_heads
    weight = self.model.get_input_embeddings().weight
    new = lambda: weight.new_zeros(1, kv_heads, self.capacity, attn.head_dim)  # noqa: E731
    cache.keys, cache.values = [new() for _ in range(self.num_layers)], [new() for _ in range(self.num_layers)]


@contextmanager
def variant(name: str):
    """The allocation of `name` for the calls inside."""
    package = StaticTarget._reserve
    if name == "capacity":
        StaticTarget._reserve = reserve_capacity
    try:
        yield
    finally:
        StaticTarget._reserve = package


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repetitions", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results" /
                   "cache_alloc_ab.json")
    args = p.parse_args()
    monitor = LoadMonitor()
    tok, target, _ = load_embedded()
    prompts, source = load_prompts("humaneval", args.prompts)
    ids = [tok(t, return_tensors="pt").input_ids for t in prompts]
    step = StaticTarget(target, (), compile=True, linear_dtype="bfloat16")
    settings = {"greedy": {}, "sampling": dict(temperature=1.0, top_k=20, top_p=0.95)}
    names = ["capacity", "grown"]

    def decode(x, setting, seed):
        return ar_generate(step, x, max_new_tokens=128, generator=torch.Generator().manual_seed(seed),
                           **settings[setting])

    for name in names:  # compiles (the first call), first calls
        with variant(name):
            decode(ids[0], "greedy", 0)
            decode(ids[0], "sampling", 0)
    rows = []
    for setting in settings:
        tokens = {n: 0 for n in names}
        seconds = {n: 0.0 for n in names}
        before = {n: [] for n in names}  # each decode's seconds before its first round
        per_rep = {n: [] for n in names}
        for rep in range(args.repetitions):
            done = {n: [0, 0.0] for n in names}
            for i, x in enumerate(ids):
                for name in (names if rep % 2 == 0 else names[::-1]):
                    with variant(name):
                        out = decode(x, setting, 1000 * rep + i)
                    done[name][0] += out.new_tokens.numel()
                    done[name][1] += out.total_s
                    before[name].append(out.prefill_s)
            for name, (n, s) in done.items():
                tokens[name] += n
                seconds[name] += s
                per_rep[name].append(n / s)
        base = tokens["capacity"] / seconds["capacity"]
        for name in names:
            rows.append(dict(setting=setting, variant=name, tokens_per_s=tokens[name] / seconds[name],
                             ratio=tokens[name] / seconds[name] / base,
                             before_first_round_ms=1e3 * statistics.mean(before[name]),
                             per_repetition=per_rep[name]))
            r = rows[-1]
            print(f"{setting:<9} {name:<9} {r['tokens_per_s']:8.1f} tokens/s  {r['ratio']:.3f}×  "
                  f"before the first round {r['before_first_round_ms']:.2f} ms")
    load = monitor.record()
    meta = dict(command="python experiments/cache_alloc_ab.py " + " ".join(sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=platform.platform(), cpu=cpu_description(), threads=torch.get_num_threads(),
                prompts=args.prompts, repetitions=args.repetitions, capacity=step.capacity, source=source,
                load=load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
