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
    if params.top_k and params.top_k < scores.size(-1):
        return _top_k_probs(scores, params)
    if params.top_p < 1.0:  # ascending, ties in index order; the masked scores (-inf) add nothing to the mass
        ordered, order = torch.sort(scores, stable=True)
        scores = scores.masked_fill(_top_p_removed(ordered, order, params.top_p), -math.inf)
    return scores.softmax(dim=-1)


def _top_k_probs(scores: Tensor, params: SamplingParams) -> Tensor:
    """process_logits with top-k on (k < V), every step after the top-k over the kept columns alone: a
    few of them where the rest would touch all V (each small operator's call costs more than its work
    at one row of a vocabulary), then p̃ scattered back to [..., V]."""
    k = params.top_k
    top, idx = torch.topk(scores, k + 1)  # [..., k + 1] descending: the score after the k-th tells of ties
    if bool((top[..., k] < top[..., k - 1]).all()):  # no row ties its k-th score beyond the k: those are kept
        kept, idx = top[..., :k], idx[..., :k]
    else:  # ties with a row's k-th score are kept: m > k columns hold them all
        kth = top[..., k - 1: k]
        top, idx = torch.topk(scores, int((scores >= kth).sum(-1).max()))
        kept = top.masked_fill(top < kth, -math.inf)  # [..., m] (a row with fewer ties: its extra columns masked)
    if params.top_p < 1.0:  # over the kept columns in index order: equal scores at the edge go in index order
        idx, by_index = idx.sort(-1)
        kept = kept.gather(-1, by_index)
        ordered, order = torch.sort(kept, stable=True)  # ascending
        kept = kept.masked_fill(_top_p_removed(ordered, order, params.top_p), -math.inf)
    return torch.zeros_like(scores).scatter_(-1, idx, kept.softmax(dim=-1))


def _top_p_removed(ordered: Tensor, order: Tensor, top_p: float) -> Tensor:
    """Scores sorted ascending (`ordered`, from the columns `order`) → which columns top-p removes: those
    whose cumulative mass, from the least, stays within 1 - top_p (the largest score always stays)."""
    removed = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    removed[..., -1:] = False
    return torch.zeros_like(removed).scatter(-1, order, removed)


def greedy_token(logits: Tensor) -> Tensor:
    """[..., V] → [...] canonical argmax (first index among ties)."""
    return logits.argmax(dim=-1)
