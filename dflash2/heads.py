"""Per-position top-K candidate head over the LM-head logits (DFlash 2)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class Candidates(NamedTuple):
    """ids [..., L, K] long, sorted by score; scores [..., L, K] unary scores U (the logits)."""

    ids: Tensor
    scores: Tensor


class CandidateHead(nn.Module):
    """logits [..., L, V] → Candidates with K = min(top_k, V). No parameters."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k

    def forward(self, logits: Tensor) -> Candidates:
        scores, ids = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)
        return Candidates(ids, scores)
