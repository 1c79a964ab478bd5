"""Training-time forward and losses of the drafter.

All blocks of a sequence go through the backbone in one masked forward pass:

    anchors a_1..a_A (random, low <= a <= T - B)        block j = [ids[a_j], MASK × (B-1)] at a_j..a_j+B-1
    context = fused features of every position 0..T-1   block j sees context positions p < a_j only (the
                                                        anchor has no target state at inference), itself
                                                        (bidirectionally, or causally in a causal layer)
                                                        and no other block; sliding windows per query
    labels: block position k (1..B-1) predicts ids[a_j + k] (same position, no shift)

`tests/train/test_forward.py` checks that this gives the inference-time drafter's block logits for the same
context: the place where public recipes have had off-by-one bugs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash2.drafter.model import DFlash2Drafter
from dflash2.drafter.heads import Candidates, RoundContext
from dflash2.targets.adapter import TargetAdapter


class BlockOutputs(NamedTuple):
    """hidden [N, A, L, H] (final-normed); labels [N, A, L]; prev [N, A, L] (the true token before each
    drafted position: the anchor, then the labels shifted by one); weights [N, A, L] (1 where the label
    counts: a real anchor, a label position inside the sequence that `label_mask` allows; else 0);
    logits [N, A, L, V] (V': over the draft vocabulary, if any) when asked for (tests), else None: the loss
    computes them in chunks; anchor_state [N, A, H]: the fused target feature of the position before
    each anchor (what a selector that reads the round's context gets as RoundContext.anchor_state at inference)."""

    hidden: Tensor
    labels: Tensor
    prev: Tensor
    weights: Tensor
    logits: Tensor | None = None
    anchor_state: Tensor | None = None


class Losses(NamedTuple):
    total: Tensor
    backbone: Tensor
    selector: Tensor
    metrics: dict[str, float | list[float]]
    confidence: Tensor | None = None


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


def sample_masked_anchors(label_mask: Tensor, lengths: Tensor, B: int, A: int, generator: torch.Generator
                          ) -> tuple[Tensor, Tensor]:
    """Anchors for variable-length sequences: (anchors [N, A'], valid [N, A'] bool), A' <= A.

    label_mask [N, T] bool (True: the token is a label, e.g. an assistant token); lengths [N]. An anchor
    a is a position whose next token is a label (label_mask[a + 1]), with a + B <= length (the whole
    block inside the sequence). Each row draws up to A distinct anchors, sorted; rows with fewer pad
    with anchor 1 and valid False (A' >= 1 always)."""
    N, T = label_mask.shape
    pos = torch.arange(T)
    ok = torch.zeros(N, T, dtype=torch.bool)
    ok[:, 1:-1] = label_mask[:, 2:].cpu()
    ok &= (pos[None] + B <= lengths.cpu()[:, None]) & (pos[None] >= 1)
    rows = []
    for n in range(N):
        cand = ok[n].nonzero()[:, 0]
        rows.append(cand[torch.randperm(len(cand), generator=generator)[:A]].sort().values)
    width = max(1, max(len(r) for r in rows))
    anchors = torch.ones(N, width, dtype=torch.long)
    valid = torch.zeros(N, width, dtype=torch.bool)
    for n, r in enumerate(rows):
        anchors[n, : len(r)], valid[n, : len(r)] = r, True
    return anchors.to(label_mask.device), valid.to(label_mask.device)


def label_weights(anchors: Tensor, L: int, label_mask: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
    """[N, A, L] float: 1 where block position k of anchor a labels a token that counts (label_mask[a + k],
    k = 1..L, on a real anchor), else 0. label_mask [N, T] bool or None (all count); valid [N, A] or None."""
    N, A = anchors.shape
    weights = torch.ones(N, A, L, device=anchors.device)
    if label_mask is not None:
        pos = (anchors[:, :, None] + 1 + torch.arange(L, device=anchors.device)).reshape(N, -1)
        weights = weights * label_mask.gather(1, pos).view(N, A, L)
    if valid is not None:
        weights = weights * valid[:, :, None]
    return weights


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
                         anchors: Tensor, *, label_mask: Tensor | None = None, valid: Tensor | None = None,
                         logits: bool = True) -> BlockOutputs:
    """ids [N, T], features [N, T, F] (the target's, for every position), anchors [N, A] with a + B <= T.

    label_mask [N, T] bool (None: every token is a label) and valid [N, A] (None: every anchor is real)
    give the outputs' `weights`; logits=False leaves the [N, A, L, V] logits to the chunked loss."""
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
    weights = label_weights(anchors, B - 1, label_mask, valid)
    before = (anchors - 1)[..., None].expand(-1, -1, features.shape[-1])  # [N, A, F]: the last context position
    anchor_state = drafter.backbone.fuse(features.gather(1, before).to(drafter.backbone.fc.weight.dtype))
    logits_out = drafter.draft_logits(hidden, target, drafter.draft_vocab) if logits else None
    return BlockOutputs(hidden, labels, prev, weights, logits_out, anchor_state)


def position_weights(L: int, gamma: float | None, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_k = exp(-(k-1)/γ) for k = 1..L (all ones when γ is None)."""
    k = torch.arange(L, device=device, dtype=dtype)
    return torch.ones(L, device=device, dtype=dtype) if gamma is None else torch.exp(-k / gamma)


class _RowwiseLoss(torch.autograd.Function):
    """loss [M] = row_loss(hidden [M, H]) computed CHUNK rows at a time, for a row_loss in which row i's
    loss depends on hidden[i] only (a cross-entropy through the LM head). Each chunk's [CHUNK, V]
    logits exist only inside the chunk: the gradient of the chunk's loss with respect to its rows is
    taken in the forward pass and kept ([M, H]); backward scales it by the incoming gradient.
    `params`: trainable tensors row_loss also reads (a drafter's own LM head); their gradient needs the
    incoming one, so backward recomputes each chunk once more for them (a frozen head costs nothing)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, row_loss, chunk: int, *params: Tensor) -> Tensor:
        M = hidden.shape[0]
        out = hidden.new_empty(M, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        grad = torch.zeros_like(hidden) if hidden.requires_grad else None
        for s in range(0, M, chunk):
            h = hidden[s: s + chunk].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                loss = row_loss(h, slice(s, s + chunk))  # [m]
                if grad is not None:
                    (grad[s: s + chunk],) = torch.autograd.grad(loss.sum(), h)
            out[s: s + chunk] = loss.detach()
        # backward recomputes the chunks only for `params`: only then does the graph keep row_loss (and the
        # modules it reads) alive, and only until backward has run
        ctx.row_loss, ctx.chunk = (row_loss if params else None), chunk
        kept = (hidden.detach(), *params) if params else ()
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0), *kept)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        grad, *kept = ctx.saved_tensors
        hidden, params = (kept[0], kept[1:]) if kept else (None, ())
        param_grads: list[Tensor | None] = [None] * len(params)
        if params and any(ctx.needs_input_grad[3:]):
            param_grads = [torch.zeros_like(p) for p in params]
            for s in range(0, hidden.shape[0], ctx.chunk):
                with torch.enable_grad():
                    loss = ctx.row_loss(hidden[s: s + ctx.chunk], slice(s, s + ctx.chunk))
                    parts = torch.autograd.grad((loss * g[s: s + ctx.chunk].to(loss.dtype)).sum(), params,
                                                allow_unused=True)
                for total, part in zip(param_grads, parts):
                    if part is not None:
                        total += part
        ctx.row_loss = None
        row_grad = grad * g[:, None].to(grad.dtype) if grad.numel() else None
        return row_grad, None, None, *param_grads


LOSS_CHUNK_ELEMENTS = 2**24  # logits alive at once in the loss: its memory bound (64 MB a tensor in float32)


def drafter_losses(drafter: DFlash2Drafter, target: TargetAdapter, out: BlockOutputs, *, gamma: float | None,
                   target_hidden: Tensor | None = None, selector_alpha: float = 0.0, confidence_alpha: float = 0.0,
                   denominators: tuple[float, float] | None = None, chunk: int | None = None) -> Losses:
    """Backbone (soft) cross-entropy with position decay, plus α · the teacher-forced K-way selector loss,
    plus β · the confidence head's binary cross-entropy (DSpark's), `chunk` rows at a time (None: as many
    as LOSS_CHUNK_ELEMENTS logits allow): no [N, A, L, V] tensor is ever whole. Over the draft vocabulary
    where the drafter has one (a label outside it carries no loss).

    The selector scores each position's candidates as U + its pairwise term from the true previous token
    (`edge_scores`), or along the gold path of its own lattice (LiLiCorr); the confidence head learns
    whether the teacher-forced pick is the label, reading detached hidden states. target_hidden [N, A, L,
    H_t]: soft targets from the target's own head (None: hard labels). The backbone loss is Σ w_k·m·ce /
    Σ w_k·m, the selector's Σ m·ce / Σ m; `denominators` replaces the two sums so that micro-batches add
    up to the step's loss (docs/training.md)."""
    N, A, L, H = out.hidden.shape
    vocab = drafter.draft_vocab  # [V'] token ids the head drafts among (None: all V): the loss is over them only
    V = target.vocab_size if vocab is None else vocab.numel()
    if chunk is None:
        chunk = max(1, LOSS_CHUNK_ELEMENTS // V)
    K = min(drafter.config.selector_top_k, V)
    rows = out.hidden.reshape(-1, H)  # [M, H], M = N·A·L
    labels = out.labels.reshape(-1)
    if vocab is not None:  # labels as indices into the draft vocabulary; -1 outside it (no loss: never drafted)
        index = torch.full((target.vocab_size,), -1, dtype=torch.long, device=labels.device)
        index[vocab] = torch.arange(V, device=labels.device)
        labels = index[labels]
    t_rows = None if target_hidden is None else target_hidden.reshape(rows.shape[0], -1)
    top1_rows = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    cand_rows = torch.zeros(rows.shape[0], K, dtype=torch.long, device=rows.device)
    log_z_rows = torch.zeros(rows.shape[0], device=rows.device)  # of the draft logits: the candidates' log-probabilities

    def row_loss(h: Tensor, s: slice) -> Tensor:
        logits = _wide(drafter.draft_logits(h, target, vocab))
        logp = logits.log_softmax(-1)  # [m, V]
        with torch.no_grad():
            top1_rows[s] = logp.argmax(-1) == labels[s]
            top = logp.topk(K, dim=-1).indices
            cand_rows[s] = top if vocab is None else vocab[top]
            log_z_rows[s] = logits.float().logsumexp(-1)
        if t_rows is None:
            return -logp.gather(-1, labels[s, None].clamp_min(0))[:, 0] * (labels[s] >= 0)
        with torch.no_grad():  # the target's distribution (over the draft vocabulary: renormalised there)
            t_logits = _wide(target.final_logits(t_rows[s]))
            p = (t_logits if vocab is None else t_logits[:, vocab]).softmax(-1)
        return -(p * logp).sum(-1)

    own_head = [] if drafter.lm_head is None or not drafter.lm_head.weight.requires_grad else [drafter.lm_head.weight]
    per_pos = _RowwiseLoss.apply(rows, row_loss, chunk, *own_head).view(N, A, L)
    m = out.weights.to(per_pos.dtype)
    w = position_weights(L, gamma, rows.device, per_pos.dtype) * m
    den_b, den_s = denominators if denominators is not None else (float(w.sum()), float(m.sum()))
    backbone = (per_pos * w).sum() / max(den_b, 1e-12)
    top1, cand = top1_rows.view(N, A, L), cand_rows.view(N, A, L, K)  # (the closure keeps writing the rows)
    covered = (cand == out.labels[..., None]).any(-1)
    count = max(float(m.sum()), 1e-12)
    by_pos = (top1 * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1e-12)
    metrics: dict[str, float | list[float]] = {
        "top1_acc": float((top1 * m).sum()) / count,
        "top1_acc_by_pos": by_pos.tolist(),
        "topk_coverage": float((covered * m).sum()) / count,
        "acceptance": float(accepted_lengths(top1, out.weights).sum()) / max(float(out.weights[..., 0].gt(0).sum()), 1.0),
        "labels": float(m.sum()),
    }
    selector = torch.zeros((), device=rows.device)
    confidence = None
    sel = drafter.candidate_selector
    if selector_alpha > 0 and sel.trains_on_candidates:
        m = m * (labels.view(N, A, L) >= 0)  # a label outside the draft vocabulary is never a candidate
        # gold in the last slot where the top-K missed it (for the loss only)
        cand = torch.where(covered[..., None], cand, torch.cat([cand[..., :-1], out.labels[..., None]], -1))
        gold = (cand == out.labels[..., None]).float().argmax(-1)  # [N, A, L]
        unary = drafter.candidate_logits(out.hidden, cand, target)  # [N, A, L, K], differentiable in hidden
        if callable(getattr(sel, "edge_scores", None)):
            scores = unary + sel.edge_scores(out.prev[..., None], out.hidden, cand)[..., 0, :]  # [N, A, L, K]
        else:
            scores = gold_path_scores(drafter, target, out, Candidates(cand, unary.detach()), log_z_rows.view(N, A, L), gold)
        ce = F.cross_entropy(_wide(scores).reshape(-1, scores.shape[-1]), gold.reshape(-1), reduction="none")
        selector = (ce * m.reshape(-1).to(ce.dtype)).sum() / max(den_s, 1e-12)
        with torch.no_grad():
            picked = scores.argmax(-1) == gold
            metrics["selector_acc"] = float((picked & covered).float().mul(m).sum()) / count
        head = getattr(sel, "confidence_logits", None)
        conf_logits = head(out.hidden.detach(), out.prev) if callable(head) else None
        if confidence_alpha > 0 and conf_logits is not None:
            hit = (picked & covered).to(conf_logits.dtype)  # the teacher-forced greedy pick is the label
            bce = F.binary_cross_entropy_with_logits(conf_logits, hit, reduction="none")
            confidence = (bce * m.to(bce.dtype)).sum() / max(den_s, 1e-12)
            metrics["confidence_loss"] = float(confidence.detach())
            with torch.no_grad():
                predicted = torch.sigmoid(conf_logits)
                metrics["confidence_by_pos"] = ((predicted * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1e-12)).tolist()
                metrics["hit_by_pos"] = ((hit * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1e-12)).tolist()
    metrics["backbone_loss"] = float(backbone.detach())
    metrics["selector_loss"] = float(selector.detach())
    total = backbone + selector_alpha * selector
    if confidence is not None:
        total = total + confidence_alpha * confidence
    return Losses(total, backbone, selector, metrics, confidence)


def gold_path_scores(drafter: DFlash2Drafter, target: TargetAdapter, out: BlockOutputs, cands: Candidates,
                     log_z: Tensor, gold: Tensor) -> Tensor:
    """A lattice selector's scores along the gold path, teacher-forced: cands [N, A, L, K] (the gold in
    them), log_z [N, A, L], gold [N, A, L] indices → [N, A, L, K]: row 0 the lattice's `first`, row t the
    successors of the gold candidate at t - 1 (steps[t-1, gold_{t-1}, ·])."""
    sel = drafter.candidate_selector
    kwargs = {}
    if sel.reads_context:
        dtype = drafter.backbone.fc.weight.dtype
        kwargs["context"] = RoundContext(log_z, out.anchor_state, target.embed(cands.ids).to(dtype))
    anchors = out.prev[..., 0]  # [N, A]: the token before the first drafted position is the anchor
    first, steps = sel.lattice(cands, out.hidden, anchors, **kwargs)  # [N, A, K], [N, A, L-1, K, K]
    K = first.shape[-1]
    prev = gold[..., :-1, None, None].expand(*gold.shape[:-1], -1, 1, K)  # [N, A, L-1, 1, K]
    return torch.cat([first[..., None, :], steps.gather(-2, prev)[..., 0, :]], dim=-2)


def _wide(x: Tensor) -> Tensor:
    """Half-precision logits in float32 for the softmax; float32 and float64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def accepted_lengths(top1: Tensor, weights: Tensor) -> Tensor:
    """[N, A] tokens a greedy verifier would accept per block: 1 (the target's own token) plus the
    drafted positions correct in a row from the first, counting labels with weight > 0 only (a block
    that runs past the sequence or into a user turn stops there). 0 for padded anchors."""
    run = torch.cumprod((top1 & (weights > 0)).to(torch.int64), dim=-1).sum(-1)
    return (run + 1) * (weights[..., 0] > 0)


def expected_tau_from_accuracy(acc_by_pos: list[float]) -> float:
    """A cheap τ proxy for progress bars: 1 + Σ_k Π_{j<=k} acc_j (independence assumed)."""
    tau, run = 1.0, 1.0
    for acc in acc_by_pos:
        run *= acc
        tau += run
    return tau if math.isfinite(tau) else float("nan")
