"""Training-time forward and losses of the drafter.

All blocks of a sequence go through the backbone in one masked forward pass:

    anchors a_1..a_A (random, low <= a <= T - B)        block j = [ids[a_j], MASK × (B-1)] at a_j..a_j+B-1
    context = fused features of every position 0..T-1   block j sees context positions p < a_j only
                                                        (strictly before its anchor: the anchor has no
                                                        target hidden state at inference), itself
                                                        (bidirectionally, or causally in a causal
                                                        layer), and no other block; a sliding layer's
                                                        window applies per query, as at inference
    labels: block position k (1..B-1) predicts ids[a_j + k] (same position, no shift)

`tests/test_training.py` checks that this gives the same block logits as the inference-time drafter
for the same context: the place where public recipes have had off-by-one bugs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .drafter import DFlash2Drafter
from .selector import CodebookSelector
from .target import TargetAdapter


class BlockOutputs(NamedTuple):
    """logits [N, A, L, V]; hidden [N, A, L, H] (final-normed); labels [N, A, L]; prev [N, A, L]
    (the true token before each drafted position: the anchor, then the labels shifted by one)."""

    logits: Tensor
    hidden: Tensor
    labels: Tensor
    prev: Tensor


class Losses(NamedTuple):
    total: Tensor
    backbone: Tensor
    selector: Tensor
    metrics: dict[str, float | list[float]]


def sample_anchors(N: int, T: int, B: int, A: int, generator: torch.Generator, low: int = 1) -> Tensor:
    """[N, A] sorted distinct anchors in [low, T - B] (every label a + k < T exists).

    Training passes low = prompt_tokens - 1, so that every label is a token the target produced:
    prompt text is context only (the drafter never has to predict what the target would not say).
    """
    high = T - B  # inclusive upper bound
    low = max(1, low)
    if high < low:
        raise ValueError(f"sequences of {T} tokens have no anchor in [{low}, {high}] for blocks of {B}")
    A = min(A, high - low + 1)
    rows = [torch.randperm(high - low + 1, generator=generator)[:A].sort().values + low for _ in range(N)]
    return torch.stack(rows)


def block_mask(anchors: Tensor, T: int, B: int, window: int | None = None) -> Tensor:
    """[N, 1, A·B, T + A·B] bool: block j sees context p < a_j (and p >= a_j - window), and itself."""
    N, A = anchors.shape
    device = anchors.device
    a = anchors.repeat_interleave(B, dim=1)[:, :, None]  # [N, A·B, 1] the anchor of each query
    p = torch.arange(T, device=device)[None, None, :]  # [1, 1, T]
    context = p < a
    if window is not None:
        context &= p >= a - window
    block_of = torch.arange(A * B, device=device) // B
    own = (block_of[:, None] == block_of[None, :]).expand(N, A * B, A * B)
    return torch.cat([context, own], dim=-1)[:, None]


def masked_block_forward(drafter: DFlash2Drafter, target: TargetAdapter, ids: Tensor, features: Tensor,
                         anchors: Tensor) -> BlockOutputs:
    """ids [N, T], features [N, T, F] (the target's, for every position), anchors [N, A]."""
    cfg = drafter.config
    N, T = ids.shape
    A, B = anchors.shape[1], cfg.block_size
    offsets = torch.arange(B, device=ids.device)
    positions = (anchors[:, :, None] + offsets).reshape(N, A * B)  # [N, A·B]
    block_ids = torch.full((N, A, B), cfg.mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    context = drafter.backbone.context_kv(features, torch.arange(T, device=ids.device))
    x = drafter.embed_block(block_ids.reshape(N, A * B), target)  # [N, A·B, H]
    mask = block_mask(anchors, T, B, cfg.context_window)
    keys = torch.cat([torch.arange(T, device=ids.device).expand(N, T), positions], dim=1)  # [N, T + A·B]
    hidden = drafter.backbone(x, positions, context, mask, key_positions=keys).view(N, A, B, -1)[:, :, 1:]  # [N, A, L, H]
    label_pos = positions.view(N, A, B)
    labels = ids.gather(1, label_pos[:, :, 1:].reshape(N, -1)).view(N, A, B - 1)
    prev = ids.gather(1, label_pos[:, :, :-1].reshape(N, -1)).view(N, A, B - 1)
    return BlockOutputs(drafter.draft_logits(hidden, target), hidden, labels, prev)


def position_weights(L: int, gamma: float | None, device=None) -> Tensor:
    """w_k = exp(-(k-1)/γ) for k = 1..L (all ones when γ is None)."""
    k = torch.arange(L, device=device, dtype=torch.float32)
    return torch.ones(L, device=device) if gamma is None else torch.exp(-k / gamma)


def drafter_losses(drafter: DFlash2Drafter, out: BlockOutputs, *, gamma: float | None,
                   soft_targets: Tensor | None = None, selector_alpha: float = 0.0) -> Losses:
    """Backbone (soft) cross-entropy with position decay, plus α · teacher-forced K-way selector loss.

    soft_targets: [N, A, L, V] target probabilities for each drafted position, or None (hard labels).
    """
    N, A, L, V = out.logits.shape
    logp = out.logits.float().log_softmax(-1)
    if soft_targets is None:
        per_pos = -logp.gather(-1, out.labels[..., None])[..., 0]  # [N, A, L]
    else:
        per_pos = -(soft_targets.float() * logp).sum(-1)
    w = position_weights(L, gamma, out.logits.device)
    backbone = (per_pos * w).sum() / (w.sum() * N * A)

    with torch.no_grad():
        top1 = out.logits.argmax(-1) == out.labels  # [N, A, L]
        K = drafter.config.selector_top_k
        cand_ids = out.logits.topk(min(K, V), dim=-1).indices  # [N, A, L, K]
        covered = (cand_ids == out.labels[..., None]).any(-1)
    metrics: dict[str, float | list[float]] = {
        "top1_acc": float(top1.float().mean()),
        "top1_acc_by_pos": top1.float().mean((0, 1)).tolist(),
        "topk_coverage": float(covered.float().mean()),
    }
    selector = torch.zeros((), device=out.logits.device)
    sel = drafter.candidate_selector
    if isinstance(sel, CodebookSelector) and selector_alpha > 0:
        # gold in the last slot where the top-K missed it (for the loss only)
        cand = torch.where(covered[..., None], cand_ids, torch.cat([cand_ids[..., :-1], out.labels[..., None]], -1))
        gold = (cand == out.labels[..., None]).float().argmax(-1)  # [N, A, L]
        unary = out.logits.gather(-1, cand)
        scores = unary + sel.edge_scores(out.prev[..., None], out.hidden, cand)[..., 0, :]  # [N, A, L, K]
        selector = F.cross_entropy(scores.float().reshape(-1, scores.shape[-1]), gold.reshape(-1))
        with torch.no_grad():
            picked = scores.argmax(-1) == gold
            metrics["selector_acc"] = float((picked & covered).float().mean())
    metrics["backbone_loss"] = float(backbone.detach())
    metrics["selector_loss"] = float(selector.detach())
    return Losses(backbone + selector_alpha * selector, backbone, selector, metrics)


def expected_tau_from_accuracy(acc_by_pos: list[float]) -> float:
    """A cheap τ proxy for progress bars: 1 + Σ_k Π_{j<=k} acc_j (independence assumed)."""
    tau, run = 1.0, 1.0
    for acc in acc_by_pos:
        run *= acc
        tau += run
    return tau if math.isfinite(tau) else float("nan")
