"""Per-position top-K candidate head over the LM-head logits (DFlash 2)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class Candidates(NamedTuple):
    """ids [..., L, K] long, sorted by score; scores [..., L, K] unary scores U (the logits)."""

    ids: Tensor
    scores: Tensor


class RoundContext(NamedTuple):
    """What a selector that declares `reads_context = True` receives as `context=` beside the lattice
    (LiLiCorr reads all three; a selector that reads none of them leaves reads_context False).

    log_z:        [..., L] log Σ_v exp(logit_v) of each draft position's draft logits: the candidates'
                  log-probabilities are `cands.scores - log_z[..., None]`;
    anchor_state: [..., H] the drafter's fused target feature (fc, then hidden_norm) of the position
                  just before the anchor: the last one the target has verified;
    embeddings:   [..., L, K, H] the target's input embeddings of the candidates (raw rows, unscaled).
    """

    log_z: Tensor
    anchor_state: Tensor
    embeddings: Tensor


class CandidateHead(nn.Module):
    """logits [..., L, V] → Candidates with K = min(top_k, V). No parameters."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k

    def forward(self, logits: Tensor) -> Candidates:
        scores, ids = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)
        return Candidates(ids, scores)
