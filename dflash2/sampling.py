"""The target's processed distribution p̃, shared by AR decoding and verification.

Semantics are Hugging Face `generate`'s sampling path: temperature, then top-k (ties with the k-th
logit are kept), then top-p (smallest set whose mass exceeds top_p, at least one token), then
softmax. One choice is ours: where tokens of equal score straddle top-p's edge, the one of lower
index is dropped first (HF drops them in the order its sort of the whole row puts them, which on
long rows is not the index order and differs between devices); top-p then needs only the kept
columns when top-k is on. `temperature == 0` means greedy: the canonical argmax is `torch.argmax` (first index
among ties), used everywhere in this package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 → greedy; top_k 0 and top_p 1.0 mean off (as in HF)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits → [..., V] processed probabilities p̃ (float32, or float64 for float64 input).

    Must not be called with greedy params: greedy decoding reads the raw argmax.
    """
    if params.greedy:
        raise ValueError("process_logits is for sampling; greedy decoding uses greedy_token")
    scores = logits.float() if logits.dtype != torch.float64 else logits
    if params.temperature != 1.0:
        scores = scores / params.temperature
    columns = None  # with top-k: [..., m] columns holding each row's kept scores, in index order
    if params.top_k:
        k = min(params.top_k, scores.size(-1))
        top_scores, top_idx = torch.topk(scores, k)  # [..., k] descending
        scores = scores.masked_fill(scores < top_scores[..., -1:], -math.inf)
        if params.top_p < 1.0:  # ties with the k-th score are kept: m >= k columns hold every kept score
            m = int((scores > -math.inf).sum(-1).max())
            columns = (top_idx if m == k else torch.topk(scores, m)[1]).sort(-1)[0]
    if params.top_p < 1.0:
        # ascending, ties in index order: the order a sort of the whole row gives (the masked scores, -inf,
        # first, adding zeros to the cumulative mass), over the m kept columns instead of V
        if columns is None:
            sorted_scores, sorted_idx = torch.sort(scores, descending=False, stable=True)
        else:
            sorted_scores, order = torch.sort(scores.gather(-1, columns), stable=True)
            sorted_idx = columns.gather(-1, order)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - params.top_p)
        sorted_remove[..., -1:] = False
        remove = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores.softmax(dim=-1)


def greedy_token(logits: Tensor) -> Tensor:
    """[..., V] → [...] canonical argmax (first index among ties)."""
    return logits.argmax(dim=-1)
