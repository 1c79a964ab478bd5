"""τ against context length, with and without the drafter's context window (the embedded pair).

    python experiments/performance/context_window.py [--window 128] [--lengths 64,256,512,1024]

Prompts are the last N tokens of held-out standard-library files (dflash2/embedded/corpus.py), followed by a
cut at a line start so the continuation is code. For each N the embedded DFlash-2 drafter decodes
greedily with its full context and with `context_window=W` (same weights, window applied at
inference; outputs stay identical to AR either way, which the script checks). Writes
docs/results/context_window.json and docs/results/context_window.png.
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

from dflash2 import ar_generate, load_embedded, spec_generate  # noqa: E402
from dflash2.embedded.corpus import read_texts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--lengths", default="64,256,512,1024")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()
    tok, target, drafter = load_embedded("dflash2")
    windowed = drafter.with_config(context_window=args.window)
    texts = [t for t in read_texts("heldout") if len(t) > 20_000][: args.prompts]
    results = {"full": {}, f"window {args.window}": {}}
    for n in map(int, args.lengths.split(",")):
        for name, d in (("full", drafter), (f"window {args.window}", windowed)):
            lengths, identical = [], 0
            for text in texts:
                ids = tok(text, return_tensors="pt").input_ids[:, :n]
                out = spec_generate(d, target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=[tok.eos_token_id])
                ref = ar_generate(target, ids, max_new_tokens=args.max_new_tokens, stop_token_ids=[tok.eos_token_id])
                identical += torch.equal(out.sequences, ref.sequences)
                lengths += out.acceptance_lengths
            results[name][n] = dict(tau=sum(lengths) / max(1, len(lengths)), identical=identical, prompts=len(texts))
            print(f"context {n:5d} {name:>12}: τ = {results[name][n]['tau']:.2f}, identical {identical}/{len(texts)}")
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(command=" ".join(sys.argv), date=str(datetime.date.today()), machine=platform.platform())
    (out / "context_window.json").write_text(json.dumps(dict(meta=meta, results=results), indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, by_len in results.items():
        ax.plot(list(by_len), [v["tau"] for v in by_len.values()], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("τ")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "context_window.png", dpi=120)
    all_identical = all(v["identical"] == v["prompts"] for r in results.values() for v in r.values())
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
