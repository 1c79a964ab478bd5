"""Frequency-ranked draft vocabularies (FR-Spec, Zhao et al. 2025).

The drafter's LM head is a V × H product per drafted position: for a 150k-token target it costs more
than the drafter's layers. Drafting among the n most frequent tokens of a corpus reads n rows instead
of V, and top-K runs over n logits. The target still verifies over the whole vocabulary, so what is
committed never changes; a round only stops early where the target wants a token outside the set.

    counts = count_tokens(tokenizer, texts, vocab_size)        # [V] occurrences
    drafter = drafter.with_draft_vocab(most_frequent(counts, 2048))
    coverage(counts, drafter.draft_vocab)                       # share of the corpus's tokens kept

Counts are saved as `{"counts": [V] int64}` safetensors (`save_counts` / `load_counts`); the embedded
pair ships the counts of its target's training corpus (`dflash2.embedded.token_counts()`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor


def count_tokens(tokenizer, texts: Iterable[str], vocab_size: int) -> Tensor:
    """Occurrences [vocab_size] int64 of every token id in the tokenized texts (no special tokens added)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"the tokenizer produced id {int(ids.max())}, outside vocab_size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def most_frequent(counts: Tensor, n: int) -> Tensor:
    """The n most frequent token ids, sorted by id (ties go to the lower id) → [n] long."""
    if not 1 <= n <= counts.numel():
        raise ValueError(f"n must be in 1..{counts.numel()}, got {n}")
    order = torch.sort(-counts.to(torch.long), stable=True).indices  # stable: ties in id order
    return order[:n].sort().values


def coverage(counts: Tensor, token_ids: Tensor) -> float:
    """The share of the counted occurrences that fall on `token_ids`."""
    total = int(counts.sum())
    return float(counts[token_ids].sum()) / total if total else 0.0


def save_counts(counts: Tensor, path: str | Path) -> None:
    save_file({"counts": counts.to(torch.long).contiguous()}, str(path))


def load_counts(path: str | Path) -> Tensor:
    counts = load_file(str(path)).get("counts")
    if counts is None or counts.dim() != 1 or counts.dtype != torch.long or bool((counts < 0).any()):
        raise ValueError(f"{path} does not hold token counts (a 1-d int64 tensor named 'counts')")
    return counts
