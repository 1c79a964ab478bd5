"""Throughput of the two regeneration backends of `python -m dflash2.train` on the embedded target.

    python experiments/performance/regen_throughput.py --out docs/results/regen_throughput [--vllm-python ~/vllm-venv/bin/python]
        [--new-tokens 128] [--repetitions 2]

The prompts: every conversation of experiments/embedded/chat_sample.jsonl, first turn, through the
embedded chat template (as the trainer renders them). Each backend continues every prompt by exactly
`--new-tokens` tokens (greedy, EOS ignored, so that both produce the same number of tokens), the same
call the trainer makes for one shard. Reported: new tokens per second of wall time, for the `hf`
backend at several batch sizes and for the `vllm` backend both with its engine start (what one
shard costs) and generation alone (the engine's own wall time). The machine's load is recorded;
time only on a quiet machine (`../shared/tools/quiet`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vllm-python", help="the interpreter of a venv with vLLM (default: no vllm rows)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 40])
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash2.bench.machine import LoadMonitor
    from dflash2.embedded import embedded_path
    from dflash2.train.data import HFBackend, Sampling, VLLMBackend, load_conversations, render

    torch.set_num_threads(args.threads)
    target_dir = embedded_path("target")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    convs = load_conversations(str(ROOT / "experiments/embedded/chat_sample.jsonl"))
    prompts = [render(tok, c.__class__(c.system, c.turns[:1]), [], None) for c in convs]
    sampling = Sampling(args.new_tokens, stop_at_eos=False)
    produced = len(prompts) * args.new_tokens
    rows, monitor = [], LoadMonitor()
    for rep in range(args.repetitions):  # interleaved: every backend once per repetition
        for batch in args.batches:
            start = time.perf_counter()
            out = HFBackend(target, [], 2, batch).generate(prompts, sampling, seed=0)
            wall = time.perf_counter() - start
            assert sum(map(len, out)) == produced
            rows.append(dict(backend="hf", batch=batch, repetition=rep, wall_s=wall, tokens=produced,
                             tokens_per_s=produced / wall))
            print(json.dumps(rows[-1]), flush=True)
        if args.vllm_python:
            start = time.perf_counter()
            backend = VLLMBackend(args.vllm_python, str(target_dir), None, [], "float32", 2048)
            out = backend.generate(prompts, sampling, seed=0)
            wall = time.perf_counter() - start
            assert sum(map(len, out)) == produced
            gen = backend.generate_wall_s  # the engine's own generation time, its start excluded
            rows.append(dict(backend="vllm", batch=len(prompts), repetition=rep, wall_s=wall, tokens=produced,
                             tokens_per_s=produced / wall, generate_wall_s=gen, generate_tokens_per_s=produced / gen))
            print(json.dumps(rows[-1]), flush=True)
    load = monitor.record()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(prompts=len(prompts), new_tokens=args.new_tokens, torch=torch.__version__,
                **load)
    (args.out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
