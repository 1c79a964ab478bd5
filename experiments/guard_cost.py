"""What a compiled StaticTarget step pays torch.compile's guards per call, and what the step takes, on the
embedded target with bfloat16 products: the shipped compile (automatic dynamic shapes, the sizes a decode
varies marked dynamic while warming up) against `dynamic=True` (every size symbolic, the weights' too,
which the step used before), two StaticTargets in one process, their plain decodes interleaved.

    python experiments/guard_cost.py [--repetitions 5] [--prompts 5]

Per variant: "TorchDynamo Cache Lookup" microseconds per call (torch.profiler: evaluating the guards of
the cached graphs until one matches) for a batch-1 one-token step and an 8-row one-token step, then
plain decoding speed at batch 1 (HumanEval prompts) and at 8 rows (20 prompts, continuous batching).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import ar_generate, load_embedded  # noqa: E402
from dflash2.decoding.batch import ar_generate_batch, left_pad  # noqa: E402
from dflash2.bench.prompts import load_prompt_set  # noqa: E402
from dflash2.bench.run import Prompter  # noqa: E402
from dflash2.compile import compile_own  # noqa: E402
from dflash2.targets.static import StaticTarget  # noqa: E402


def lookup_us(fn) -> float:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    events = [e for e in p.key_averages() if "Cache Lookup" in e.key]
    return sum(e.cpu_time_total for e in events) / max(1, sum(e.count for e in events))


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, target, _ = load_embedded()
    prompts = load_prompt_set("humaneval", 20, None)
    prompter = Prompter(tokenizer, "auto", None)
    ids = [torch.tensor([prompter.ids(prompts, c, [])]) for c in prompts.conversations]
    batch = left_pad(ids, tokenizer.eos_token_id)
    kw = dict(max_new_tokens=128, stop_token_ids=[tokenizer.eos_token_id])
    variants = {}
    for name in ("dynamic=True", "shipped"):
        st = StaticTarget(target, compile=True, linear_dtype="bfloat16")
        if name == "dynamic=True":
            st._runs = {kind: compile_own(st._step, dynamic=True) for kind in st._runs}
        variants[name] = st

    def one_token_steps(st: StaticTarget, rows: int, n: int = 50) -> None:
        cache, pos = st.new_cache(), torch.arange(300).expand(rows, 300)
        st.forward_masked(torch.zeros(rows, 300, dtype=torch.long), pos, pos,
                          torch.ones(rows, 300, 300, dtype=torch.bool).tril(), cache)
        for _ in range(n):
            S = cache.length
            st.forward_masked(torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), S),
                              torch.arange(S + 1).expand(rows, S + 1), torch.ones(rows, 1, S + 1, dtype=torch.bool), cache)

    def batch1_steps(st: StaticTarget, n: int = 50) -> None:
        cache = st.new_cache()
        st.forward(torch.zeros(1, 300, dtype=torch.long), cache)
        for _ in range(n):
            st.forward(torch.zeros(1, 1, dtype=torch.long), cache)

    def decode(st: StaticTarget) -> tuple[float, float]:
        t = n = 0.0
        for prompt in ids[: args.prompts]:
            out = ar_generate(st, prompt, **kw)
            t, n = t + out.total_s, n + out.new_tokens.numel()
        rows = ar_generate_batch(st, *batch, concurrency=8, **kw)
        return n / t, sum(r.new_tokens.numel() for r in rows) / rows[0].total_s

    for st in variants.values():  # warm-up: compiles, first calls
        decode(st)
        one_token_steps(st, 8, 3)
    for name, st in variants.items():
        print(f"{name:>13}: guards per call {lookup_us(lambda: batch1_steps(st)):.0f} µs (batch 1), "
              f"{lookup_us(lambda: one_token_steps(st, 8)):.0f} µs (8 rows)")
    for rep in range(args.repetitions):
        speeds = {name: decode(st) for name, st in variants.items()}
        (a1, a8), (b1, b8) = speeds["dynamic=True"], speeds["shipped"]
        print(f"repetition {rep + 1}: plain decoding, shipped / dynamic=True: batch 1 {b1:.0f} / {a1:.0f} tok/s "
              f"= {b1 / a1:.3f}; 8 rows {b8:.0f} / {a8:.0f} tok/s = {b8 / a8:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
