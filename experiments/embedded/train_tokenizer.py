"""Train the byte-level BPE tokenizer of the embedded pair on the corpus's train split.

    python experiments/embedded/train_tokenizer.py [--vocab-size 4096] [--out dflash2/embedded/tokenizer]

Special tokens: <|endoftext|> (id 0, end of each file; the stop token), <|mask|> (id 1, the
drafter's mask token: never produced by the BPE, so the target never emits it), <|pad|> (id 2).
The directory loads with `transformers.AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash2.embedded.corpus import read_texts  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]


def train(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_texts("train"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|mask|>",
                                   pad_token="<|pad|>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("dflash2/embedded/tokenizer"))
    args = p.parse_args()
    train(args.vocab_size, args.out)
