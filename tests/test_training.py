"""Train and inference agree: the masked multi-block training forward gives the inference drafter's
block logits for the same context, and the losses train what they should."""

from __future__ import annotations

import pytest
import torch

import dflash2.training as training
from dflash2 import DFlash2Drafter, TargetAdapter
from dflash2.training import block_mask, drafter_losses, masked_block_forward, sample_anchors
from tests.helpers import MASK, tiny_target

VARIANTS = [("two_tap", "walk", None), ("none", "argmax", None), ("two_tap", "viterbi", 6)]
REFERENCE_OPTIONS = dict(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)


def trained_looking_drafter(target, conv, selector, window, B=5, **options):
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(target, block_size=B, conv=conv, selector=selector, selector_top_k=4,
                                   selector_rank=8, mask_token_id=MASK, context_window=window, num_layers=2,
                                   **options)
    with torch.no_grad():  # away from the identity init, so the conv's causality matters
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d


def inference_logits(d, adapter, ids, feats, anchor):
    cache = d.new_cache()
    d.backbone.extend_context(cache, feats[:, :anchor])
    hidden = d.block_hidden(cache, int(ids[0, anchor]), adapter)
    return d.draft_logits(hidden[0, 1:], adapter)


@pytest.mark.parametrize("options", [{}, REFERENCE_OPTIONS], ids=["plain", "reference_options"])
@pytest.mark.parametrize("conv, selector, window", VARIANTS)
def test_training_forward_equals_inference_forward(conv, selector, window, options):
    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, conv, selector, window, **options)
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MASK, (2, 24), generator=g)
    with torch.no_grad():
        feats = torch.cat([adapter.forward(ids[i:i + 1], adapter.new_cache()).features for i in range(2)])
        anchors = torch.tensor([[1, 9, 10, 17], [2, 3, 12, 19]])  # overlapping blocks, first and last anchors
        out = masked_block_forward(d, adapter, ids, feats, anchors)
        for n in range(2):
            for j, a in enumerate(anchors[n].tolist()):
                want = inference_logits(d, adapter, ids[n:n + 1], feats[n:n + 1], a)
                torch.testing.assert_close(out.logits[n, j], want, rtol=0, atol=1e-10)
                assert out.labels[n, j].tolist() == ids[n, a + 1:a + 5].tolist()
                assert out.prev[n, j].tolist() == ids[n, a:a + 4].tolist()


def test_agreement_test_catches_the_anchor_leak(monkeypatch):
    """Mutant: `<=` in the context mask lets a block see its anchor's own feature; must disagree."""
    def leaky(anchors, T, B, window=None):
        mask = block_mask(anchors, T, B, window)
        a = anchors.repeat_interleave(B, dim=1)[:, :, None]
        mask[:, 0, :, :T] |= torch.arange(T)[None, None, :] == a
        return mask

    monkeypatch.setattr(training, "block_mask", leaky)
    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, "two_tap", "walk", None)
    adapter = TargetAdapter(target, d.target_layer_ids)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = adapter.forward(ids, adapter.new_cache()).features
        out = masked_block_forward(d, adapter, ids, feats, torch.tensor([[6]]))
        assert not torch.allclose(out.logits[0, 0], inference_logits(d, adapter, ids, feats, 6), atol=1e-6)


def test_block_mask_shape_and_rules():
    m = block_mask(torch.tensor([[2, 5]]), T=8, B=3)[0, 0]
    assert m.shape == (6, 8 + 6)
    assert m[0, :8].tolist() == [True, True] + [False] * 6  # block at anchor 2 sees positions 0, 1
    assert m[3, :8].tolist() == [True] * 5 + [False] * 3
    assert m[:3, 8:11].all() and not m[:3, 11:].any()
    windowed = block_mask(torch.tensor([[5]]), T=8, B=3, window=2)[0, 0]
    assert windowed[0, :8].tolist() == [False, False, False, True, True, False, False, False]


def test_sample_anchors_in_range_and_distinct():
    a = sample_anchors(3, 40, 8, 10, torch.Generator().manual_seed(0))
    assert a.shape == (3, 10)
    assert (a >= 1).all() and (a <= 32).all()
    assert all(len(set(row.tolist())) == 10 for row in a)
    with pytest.raises(ValueError, match="no anchor"):
        sample_anchors(1, 8, 8, 2, torch.Generator())
    # responses only: with a 20-token prompt the first label is the first generated token (position 20)
    r = sample_anchors(4, 40, 8, 100, torch.Generator().manual_seed(1), low=19)
    assert r.shape == (4, 32 - 19 + 1) and (r >= 19).all() and (r <= 32).all()
    assert all(len(set(row.tolist())) == r.shape[1] for row in r)


def test_losses_train_the_drafter_not_the_target():
    target = tiny_target("qwen3")
    for p in target.parameters():
        p.requires_grad_(False)
    d = trained_looking_drafter(target, "two_tap", "walk", None)
    adapter = TargetAdapter(target, d.target_layer_ids)
    ids = torch.randint(0, MASK, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = torch.cat([adapter.forward(ids[i:i + 1], adapter.new_cache()).features for i in range(2)])
    out = masked_block_forward(d, adapter, ids, feats, sample_anchors(2, 30, 5, 4, torch.Generator().manual_seed(0)))
    losses = drafter_losses(d, out, gamma=4.0, selector_alpha=0.5)
    losses.total.backward()
    assert losses.selector > 0 and losses.backbone > 0
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["candidate_selector.hidden_projection.weight"].abs().sum() > 0
    assert all(p.grad is None for p in target.parameters())
    m = losses.metrics
    assert len(m["top1_acc_by_pos"]) == 4 and 0 <= m["topk_coverage"] <= 1 and 0 <= m["selector_acc"] <= 1
