"""Count the embedded target's training corpus by token: the frequencies that rank a draft vocabulary.

    python experiments/embedded/count_tokens.py      # writes dflash2/embedded/token_counts.safetensors

The corpus is the train split of `python -m dflash2.embedded.corpus` (the standard library's source the target
was trained on; held-out modules and HumanEval are never read). Prints the coverage of the most
frequent 512 .. 4096 tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from dflash2.embedded.corpus import read_texts  # noqa: E402
from dflash2.drafter.draft_vocab import count_tokens, coverage, most_frequent, save_counts  # noqa: E402
from dflash2.embedded import embedded_path  # noqa: E402

OUT = embedded_path("token_counts.safetensors")


def main() -> int:
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_path("tokenizer")))
    texts = read_texts("train")
    counts = count_tokens(tokenizer, texts, len(tokenizer))
    save_counts(counts, OUT)
    print(f"{len(texts)} files, {int(counts.sum())} tokens → {OUT}")
    for n in (512, 1024, 2048, 3072, 4096):
        if n <= counts.numel():
            print(f"  the {n} most frequent tokens cover {coverage(counts, most_frequent(counts, n)):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
