"""Decoding τ of a SmolLM2 drafter (float32, greedy, our loop) on three prompt sets: the first training
prompts, the last (held-out) ones, and HumanEval in the chat template. Set beside the training log's
teacher-forced held-out τ, it separates a harder suite from a gap between training and decoding.

    python experiments/real_target/decode_tau.py --drafter runs/smollm2/dflash2/final [--prompts 5] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, spec_generate  # noqa: E402
from dflash2.bench.prompts import load_prompt_set  # noqa: E402
from dflash2.targets.gguf import resolve_target  # noqa: E402


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="a drafter directory trained for the smollm2 target")
    p.add_argument("--prompts", type=int, default=5, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = resolve_target("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = DFlash2Drafter.from_pretrained(args.drafter).float().eval()
    requests = [json.loads(line)["messages"] for line in open(ROOT / "experiments" / "real_target" / "prompts.jsonl")]
    humaneval = load_prompt_set("humaneval-instruct", args.prompts, None)
    sets = {"training (first)": requests[: args.prompts], "held out (last)": requests[-args.prompts:],
            "humaneval-instruct": [[{"role": "user", "content": c.turns[0]}] for c in humaneval.conversations]}
    for name, conversations in sets.items():
        lengths = []
        for messages in conversations:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            lengths += spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens).acceptance_lengths
        print(f"{name}: τ {sum(lengths) / len(lengths):.2f} over {len(lengths)} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
