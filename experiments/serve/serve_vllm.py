"""Serve the embedded drafters with vLLM and set the engine beside our loop on the same prompts.

    python experiments/serve/serve_vllm.py --vllm-python /path/to/vllm-venv/bin/python \
        [--prompts 8] [--max-new-tokens 128] [--out runs/serve]

Exports the embedded DFlash-1 and DFlash-2 drafters with `save_pretrained(format="reference")`,
serves each with vLLM's offline API next to the embedded target
(`LLM(model=target, speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 15})`),
checks that the served greedy outputs equal the target's own greedy outputs, and prints the engine's
τ and per-position acceptance next to our loop's. What the engine refuses (vLLM's CPU build refuses
DFlash 2) is reported, not hidden. Writes RESULTS/results.json, which docs/results.md shows. Needs a venv with vLLM
(docs/checkpoints.md, "Serving with vLLM"); dflash2 itself runs in this interpreter.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from dflash2 import ar_generate, spec_generate
from dflash2.embedded import embedded_path, load_embedded
from dflash2.bench.prompts import NAMES, load_prompts
from dflash2.engines.vllm import run_vllm


def our_rows(drafter, target, prompts, max_new_tokens):
    """Our loop: outputs, τ (committed tokens per round) and per-position acceptance."""
    outputs, lengths = [], []
    for ids in prompts:
        out = spec_generate(drafter, target, torch.tensor([ids]), max_new_tokens=max_new_tokens)
        outputs.append(out.new_tokens.tolist())
        lengths += out.acceptance_lengths
    L = drafter.config.block_size - 1
    by_position = [sum(a - 1 > i for a in lengths) / len(lengths) for i in range(L)]
    return outputs, sum(lengths) / len(lengths), by_position


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM installed")
    parser.add_argument("--dataset", default="humaneval", choices=NAMES)
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts of the dataset (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/serve"), help="the exported drafters go here")
    parser.add_argument("--results", type=Path, default=Path("docs/results/serve_vllm"),
                        help="results.json (results_sliding<W>.json) goes here; docs/results.md reads it")
    parser.add_argument("--variants", nargs="+", default=["dflash1", "dflash2"], choices=["dflash1", "dflash2"])
    parser.add_argument("--sliding-window", type=int, default=None, metavar="W",
                        help="export (and run ours) with every drafter layer sliding_attention, window W, "
                             "is_causal false: the engine must follow the same per-query window")
    args = parser.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python} does not exist")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    texts, source = load_prompts(args.dataset, args.prompts)
    tokenizer, target, _ = load_embedded("dflash2")
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    greedy = [ar_generate(target, torch.tensor([p]), max_new_tokens=args.max_new_tokens).new_tokens.tolist()
              for p in prompts]
    target_dir = embedded_path("target")
    results = {"meta": {"dataset": source, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                        "sliding_window": args.sliding_window,
                        "machine": platform.machine(), "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rows": []}

    plain = run_vllm(args.vllm_python, target_dir, prompts, max_new_tokens=args.max_new_tokens)
    results["meta"]["vllm"] = plain.vllm_version
    results["rows"].append({"method": "vllm plain decoding", "error": plain.error,
                            "equals_target_greedy": plain.outputs == greedy if not plain.error else None,
                            "tokens_per_s": plain.tokens_per_s})
    print(f"vLLM {plain.vllm_version} plain decoding: " + (plain.error or
          f"outputs equal the target's greedy: {plain.outputs == greedy}, {plain.tokens_per_s:.0f} tok/s"))
    for variant in args.variants:
        _, _, drafter = load_embedded(variant)
        if args.sliding_window is not None:
            drafter = drafter.with_config(layer_types=("sliding_attention",) * drafter.config.num_layers,
                                          sliding_window=args.sliding_window, is_causal=False)
        export = args.out / (f"{variant}_reference" + (f"_sliding{args.sliding_window}" if args.sliding_window else ""))
        drafter.save_pretrained(export, format="reference")
        ours, our_tau, our_positions = our_rows(drafter, target, prompts, args.max_new_tokens)
        served = run_vllm(args.vllm_python, target_dir, prompts, max_new_tokens=args.max_new_tokens,
                          drafter=export, num_speculative_tokens=drafter.config.block_size - 1)
        row = {"method": f"vllm + {variant} (exported)", "export": str(export), "error": served.error,
               "ours_tau": our_tau, "ours_acceptance_by_position": our_positions,
               "ours_equal_target_greedy": ours == greedy}
        print(f"\n{variant}: exported to {export}; our loop τ {our_tau:.3f}, outputs equal the target's greedy: "
              f"{ours == greedy}")
        if served.error:
            print(f"  vLLM refused: {served.error}")
        else:
            row |= {"equals_target_greedy": served.outputs == greedy, "vllm_tau": served.tau,
                    "vllm_acceptance_by_position": served.acceptance_by_position,
                    "tokens_per_s": served.tokens_per_s, "spec_decode": served.spec_decode,
                    "tau_ratio": served.tau / our_tau if served.tau else None}
            print(f"  vLLM: outputs equal the target's greedy: {served.outputs == greedy}; τ {served.tau:.3f} "
                  f"({100 * (served.tau / our_tau - 1):+.1f}% against ours); {served.tokens_per_s:.0f} tok/s")
            print("  acceptance by position (ours / vLLM): " + ", ".join(
                f"{a:.2f}/{b:.2f}" for a, b in zip(our_positions, served.acceptance_by_position)))
        results["rows"].append(row)
    name = "results.json" if args.sliding_window is None else f"results_sliding{args.sliding_window}.json"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.results / name}")
    failed = [r for r in results["rows"] if r.get("equals_target_greedy") is False or r.get("ours_equal_target_greedy") is False]
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM's workers re-import their entry point; this script only starts them
    sys.exit(main())
