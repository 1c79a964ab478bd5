"""Train and inference agree: the masked multi-block training forward gives the inference drafter's
block logits for the same context, and the losses train what they should."""

from __future__ import annotations

import pytest
import torch

import dflash2.train.forward as training
from dflash2 import DFlash2Drafter, TargetAdapter
from dflash2.train.forward import block_mask, drafter_losses, masked_block_forward, sample_anchors
from tests.helpers import MASK, tiny_target

VARIANTS = [("two_tap", "walk", None), ("none", "argmax", None), ("two_tap", "viterbi", 6), ("none", "dspark", None),
            ("two_tap", "lilicorr", None), ("none", "lilicorr", 6)]
REFERENCE_OPTIONS = dict(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)


def trained_looking_drafter(target, conv, selector, window, B=5, **options):
    torch.manual_seed(0)
    options = {"confidence_head": True, "confidence_with_markov": True, **options} if selector == "dspark" else options
    d = DFlash2Drafter.from_target(target, block_size=B, conv=conv, selector=selector, selector_top_k=4,
                                   selector_rank=8, mask_token_id=MASK, context_window=window, num_layers=2,
                                   lilicorr_num_layers=1, lilicorr_factor_dim=8, **options)
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


@pytest.mark.parametrize("conv, selector, window", [v for v in VARIANTS if v[1] in ("dspark", "lilicorr", "walk")])
def test_training_lattice_equals_inference_lattice(conv, selector, window):
    """The selector loss scores, along a gold path, what the inference round's lattice scores: the same
    first row from the anchor (for LiLiCorr: the same anchor state, the feature before the anchor, the
    same log-probabilities and embeddings) and the same successor rows."""
    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, conv, selector, window)
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MASK, (1, 24), generator=g)
    with torch.no_grad():
        feats = adapter.forward(ids, adapter.new_cache()).features
        anchors = torch.tensor([[3, 11, 18]])
        out = training.masked_block_forward(d, adapter, ids, feats, anchors)
        for j, a in enumerate(anchors[0].tolist()):
            s = d.draft_round(d.new_cache(), int(ids[0, a]), feats[:, :a], adapter)
            L, K = s.cands.ids.shape
            gold = torch.randint(0, K, (1, 1, L), generator=g)
            _, log_z = d.draft_candidates(out.hidden[0, j], adapter, with_log_z=True)
            sub = out._replace(hidden=out.hidden[:, j:j + 1], prev=out.prev[:, j:j + 1],
                               anchor_state=out.anchor_state[:, j:j + 1])
            cands = training.Candidates(s.cands.ids[None, None], s.cands.scores[None, None])
            got = training.gold_path_scores(d, adapter, sub, cands, log_z[None, None], gold)[0, 0]  # [L, K]
            torch.testing.assert_close(got[0], s.first, rtol=0, atol=1e-9)
            for t in range(1, L):
                torch.testing.assert_close(got[t], s.steps[t - 1, gold[0, 0, t - 1]], rtol=0, atol=1e-9)


def test_lattice_agreement_catches_the_anchor_state_of_the_anchor_itself(monkeypatch):
    """Mutant: the anchor state from the anchor's own position (not the one before it) must disagree."""
    real = training.masked_block_forward

    def shifted(drafter, target, ids, features, anchors, **kw):
        return real(drafter, target, ids, torch.cat([features[:, 1:], features[:, -1:]], 1), anchors, **kw)._replace(
            hidden=real(drafter, target, ids, features, anchors, **kw).hidden)

    monkeypatch.setattr(training, "masked_block_forward", shifted)
    with pytest.raises(AssertionError):
        test_training_lattice_equals_inference_lattice("none", "lilicorr", None)


@pytest.mark.parametrize("selector", ["dspark", "lilicorr"])
def test_dspark_and_lilicorr_losses_train_their_heads(selector):
    target = tiny_target("qwen3")
    target.requires_grad_(False)
    d = trained_looking_drafter(target, "none", selector, None)
    adapter = TargetAdapter(target, d.target_layer_ids)
    ids = torch.randint(0, MASK, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = torch.cat([adapter.forward(ids[i:i + 1], adapter.new_cache()).features for i in range(2)])
    anchors = sample_anchors(2, 30, 5, 4, torch.Generator().manual_seed(0))
    for beta in (0.0, 0.5):
        d.zero_grad()
        out = masked_block_forward(d, adapter, ids, feats, anchors, logits=False)
        losses = drafter_losses(d, adapter, out, gamma=4.0, selector_alpha=0.5, confidence_alpha=beta)
        losses.total.backward()
        grads = {n: p.grad for n, p in d.named_parameters()}
        assert losses.selector > 0
        sel = {n: g for n, g in grads.items() if n.startswith("candidate_selector.") and "confidence_head" not in n}
        assert sel and all(g is not None and torch.isfinite(g).all() for g in sel.values())
        assert sum(float(g.abs().sum()) for g in sel.values()) > 0
        if selector == "dspark":
            head = grads["candidate_selector.confidence_head.proj.weight"]
            assert (head is not None and head.abs().sum() > 0) == (beta > 0)
            if beta > 0:
                assert 0 < losses.metrics["confidence_loss"] and len(losses.metrics["confidence_by_pos"]) == 4
        else:
            assert losses.confidence is None


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
    losses = drafter_losses(d, adapter, out, gamma=4.0, selector_alpha=0.5)
    losses.total.backward()
    assert losses.selector > 0 and losses.backbone > 0
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["candidate_selector.hidden_projection.weight"].abs().sum() > 0
    assert all(p.grad is None for p in target.parameters())
    m = losses.metrics
    assert len(m["top1_acc_by_pos"]) == 4 and 0 <= m["topk_coverage"] <= 1 and 0 <= m["selector_acc"] <= 1


# -- the chunked loss: equal to the loss over whole [N, A, L, V] tensors ------------------------------
def full_losses(d, adapter, out, target_logits, gamma, alpha):
    """The loss as written before chunking (every logit materialised), with the label weights: the reference."""
    logits = d.draft_logits(out.hidden, adapter)  # [N, A, L, V]
    logp = logits.log_softmax(-1)
    if target_logits is None:
        per_pos = -logp.gather(-1, out.labels[..., None])[..., 0]
    else:
        per_pos = -(target_logits.softmax(-1) * logp).sum(-1)
    L = logits.shape[2]
    w = torch.exp(-torch.arange(L, dtype=logits.dtype) / gamma) * out.weights
    backbone = (per_pos * w).sum() / w.sum()
    K = d.config.selector_top_k
    cand = logits.topk(K, dim=-1).indices
    covered = (cand == out.labels[..., None]).any(-1)
    cand = torch.where(covered[..., None], cand, torch.cat([cand[..., :-1], out.labels[..., None]], -1))
    gold = (cand == out.labels[..., None]).double().argmax(-1)
    scores = logits.gather(-1, cand) + d.candidate_selector.edge_scores(out.prev[..., None], out.hidden, cand)[..., 0, :]
    ce = torch.nn.functional.cross_entropy(scores.reshape(-1, K), gold.reshape(-1), reduction="none")
    selector = (ce * out.weights.reshape(-1)).sum() / out.weights.sum()
    return backbone + alpha * selector


NARROW = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)  # its own embedding and LM head, trained


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft_targets"])
@pytest.mark.parametrize("options", [{}, REFERENCE_OPTIONS, NARROW], ids=["plain", "reference_options", "narrow_own_head"])
def test_chunked_loss_and_gradients_equal_the_full_loss(soft, options):
    target = tiny_target("qwen3")
    target.requires_grad_(False)
    d = trained_looking_drafter(target, "two_tap", "walk", None, **options)
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, MASK, (2, 30), generator=g)
    label_mask = torch.rand(2, 30, generator=g) > 0.3  # holes: prompt and user tokens are no labels
    lengths = torch.tensor([30, 9])
    with torch.no_grad():
        t_out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([t_out.hidden_states[i + 1] for i in d.target_layer_ids], dim=-1)
    anchors, valid = training.sample_masked_anchors(label_mask, lengths, 5, 6, g)
    assert not valid.all()  # the shorter row pads
    results = []
    for chunked in (True, False):
        d.zero_grad()
        out = masked_block_forward(d, adapter, ids, feats, anchors, label_mask=label_mask, valid=valid, logits=False)
        N, A, L = out.labels.shape
        pos = (anchors[:, :, None] + torch.arange(L)).reshape(N, -1)
        t_hidden = t_out.hidden_states[-1].gather(1, pos[..., None].expand(-1, -1, 32)).view(N, A, L, -1) if soft else None
        if chunked:  # 7 rows a chunk: chunks that cut across blocks and a ragged last one
            total = drafter_losses(d, adapter, out, gamma=4.0, target_hidden=t_hidden, selector_alpha=0.5, chunk=7).total
        else:
            t_logits = t_out.logits.gather(1, pos[..., None].expand(-1, -1, t_out.logits.shape[-1])).view(N, A, L, -1)
            total = full_losses(d, adapter, out, t_logits if soft else None, 4.0, 0.5)
        total.backward()
        results.append((total.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (chunked_loss, chunked_grads), (full_loss, full_grads) = results
    torch.testing.assert_close(chunked_loss, full_loss, rtol=0, atol=1e-10)
    assert chunked_grads.keys() == full_grads.keys() and len(full_grads) > 5
    if options is NARROW:  # the drafter's own head and embedding train (the head through the chunked loss)
        assert {"lm_head.weight", "embed_tokens.weight"} <= full_grads.keys()
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], rtol=0, atol=1e-10,
                                   msg=lambda m: f"{name}: {m}")


def test_chunked_loss_catches_a_wrong_gradient(monkeypatch):
    """Mutant: the backward forgets to scale by the incoming gradient (a loss weighted after the chunked
    cross-entropy would then train with the wrong weights); the equality test must see it."""
    def unscaled(ctx, g):
        grad, *_ = ctx.saved_tensors
        return grad, None, None

    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, "none", "argmax", None)
    adapter = TargetAdapter(target, d.target_layer_ids)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = torch.cat([target(input_ids=ids, output_hidden_states=True).hidden_states[i + 1]
                           for i in d.target_layer_ids], -1)
    out = masked_block_forward(d, adapter, ids, feats, torch.tensor([[3, 9]]), logits=False)
    hidden = out.hidden.detach().requires_grad_()
    grads = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(training._RowwiseLoss, "backward", staticmethod(unscaled))
        h = hidden.clone()
        loss = drafter_losses(d, adapter, out._replace(hidden=h), gamma=4.0, chunk=5).total
        grads.append(torch.autograd.grad(loss, hidden)[0])
    assert not torch.allclose(grads[0], grads[1])


def test_chunked_loss_catches_a_frozen_own_head(monkeypatch):
    """Mutant: the chunked loss trains the rows but not a drafter's own LM head (the head's gradient would
    be silently zero, or only the selector's share); the equality test must see it."""
    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, "none", "argmax", None, **NARROW)
    adapter = TargetAdapter(target, d.target_layer_ids)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = torch.cat([target(input_ids=ids, output_hidden_states=True).hidden_states[i + 1]
                           for i in d.target_layer_ids], -1)
    grads = []
    for patch in (False, True):
        if patch:
            apply = training._RowwiseLoss.apply
            monkeypatch.setattr(training._RowwiseLoss, "apply", lambda rows, fn, chunk, *params: apply(rows, fn, chunk))
        d.zero_grad()
        out = masked_block_forward(d, adapter, ids, feats, torch.tensor([[3, 9]]), logits=False)
        drafter_losses(d, adapter, out, gamma=4.0, chunk=5).total.backward()
        grads.append(d.lm_head.weight.grad)
    assert grads[0] is not None and grads[0].abs().sum() > 0 and grads[1] is None


def test_masked_anchors_only_where_the_next_token_is_a_label():
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, 8:15] = True  # an answer at 8..14, then a user turn
    mask[1, 3:20] = True
    anchors, valid = training.sample_masked_anchors(mask, torch.tensor([15, 18]), 4, 50, torch.Generator().manual_seed(0))
    for n, length in enumerate([15, 18]):
        got = anchors[n][valid[n]].tolist()
        want = [a for a in range(1, 20) if a + 1 < 20 and mask[n, a + 1] and a + 4 <= length]
        assert got == want  # all of them (50 > available), sorted
    none, valid = training.sample_masked_anchors(torch.zeros(1, 9, dtype=torch.bool), torch.tensor([9]), 4, 3,
                                                 torch.Generator())
    assert none.shape == (1, 1) and not valid.any()  # a row without labels trains nothing


def test_accepted_lengths_stop_at_the_first_miss_or_masked_label():
    top1 = torch.tensor([[[True, True, False, True], [True, True, True, True], [False, True, True, True]]])
    weights = torch.tensor([[[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1.]]])
    assert training.accepted_lengths(top1, weights).tolist() == [[3, 3, 1]]
    assert training.accepted_lengths(top1, weights * 0).tolist() == [[0, 0, 0]]


def test_training_forward_equals_inference_forward_with_padding():
    """Two sequences of different lengths, right-padded into one batch, with a label mask: every real
    anchor's block logits equal the inference drafter's on the unpadded sequence."""
    target = tiny_target("qwen3")
    d = trained_looking_drafter(target, "two_tap", "walk", None)
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = torch.Generator().manual_seed(6)
    lengths = [24, 15]
    rows = [torch.randint(0, MASK, (1, n), generator=g) for n in lengths]
    ids = torch.full((2, 24), 7)  # pad id 7: a real token, so that padding would show if it leaked
    label_mask = torch.zeros(2, 24, dtype=torch.bool)
    for n, r in enumerate(rows):
        ids[n, : r.shape[1]] = r[0]
        label_mask[n, 5: r.shape[1]] = True  # a 5-token prompt, then the answer
    attention = (torch.arange(24)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in d.target_layer_ids], -1)
        anchors, valid = training.sample_masked_anchors(label_mask, torch.tensor(lengths), 5, 20, g)
        blocks = masked_block_forward(d, adapter, ids, feats, anchors, label_mask=label_mask, valid=valid)
        checked = 0
        for n, r in enumerate(rows):
            own = torch.cat([adapter.forward(r, adapter.new_cache()).features])
            for j in valid[n].nonzero()[:, 0].tolist():
                a = int(anchors[n, j])
                torch.testing.assert_close(blocks.logits[n, j], inference_logits(d, adapter, r, own, a),
                                           rtol=0, atol=1e-10)
                checked += 1
    assert checked > 10 and not valid.all()  # the short row pads its anchors


def draft_vocab_losses(d, adapter, out, target_logits, gamma, alpha):
    """The loss over a draft vocabulary, every logit materialised: cross-entropy over its tokens' logits,
    nothing for a label outside it (never drafted), candidates among its tokens."""
    vocab = d.draft_vocab
    logits = d.draft_logits(out.hidden, adapter)[..., vocab]  # [N, A, L, V']
    logp = logits.log_softmax(-1)
    where = {int(t): i for i, t in enumerate(vocab)}
    local = torch.tensor([[[where.get(int(t), -1) for t in row] for row in block] for block in out.labels])
    inside = local >= 0
    if target_logits is None:
        per_pos = -logp.gather(-1, local.clamp_min(0)[..., None])[..., 0] * inside
    else:
        per_pos = -(target_logits[..., vocab].softmax(-1) * logp).sum(-1)
    L = logits.shape[2]
    w = torch.exp(-torch.arange(L, dtype=logits.dtype) / gamma) * out.weights
    backbone = (per_pos * w).sum() / w.sum()
    cand = vocab[logits.topk(d.config.selector_top_k, dim=-1).indices]
    covered = (cand == out.labels[..., None]).any(-1)
    cand = torch.where(covered[..., None], cand, torch.cat([cand[..., :-1], out.labels[..., None]], -1))
    gold = (cand == out.labels[..., None]).double().argmax(-1)
    full = d.draft_logits(out.hidden, adapter)
    scores = full.gather(-1, cand) + d.candidate_selector.edge_scores(out.prev[..., None], out.hidden, cand)[..., 0, :]
    ce = torch.nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]), gold.reshape(-1), reduction="none")
    selector = (ce * (out.weights * inside).reshape(-1)).sum() / out.weights.sum()
    return backbone + alpha * selector


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft_targets"])
def test_the_draft_vocabulary_loss_is_the_loss_over_its_tokens(soft):
    """Trained over a draft vocabulary (the head's rows of its tokens only): the chunked loss and its
    gradients equal the loss written out over those tokens; with every token in it, the plain loss."""
    target = tiny_target("qwen3")
    target.requires_grad_(False)
    base = trained_looking_drafter(target, "two_tap", "walk", None)
    V = base.config.vocab_size
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MASK, (2, 30), generator=g)
    label_mask = torch.rand(2, 30, generator=g) > 0.3
    with torch.no_grad():
        t_out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([t_out.hidden_states[i + 1] for i in base.target_layer_ids], dim=-1)
    anchors, valid = training.sample_masked_anchors(label_mask, torch.tensor([30, 30]), 5, 6, g)
    half = torch.randperm(V, generator=g)[: V // 2].sort().values  # half of the labels fall outside it

    def losses(d, full: bool):
        adapter = TargetAdapter(target, d.target_layer_ids)
        d.zero_grad()
        out = masked_block_forward(d, adapter, ids, feats, anchors, label_mask=label_mask, valid=valid, logits=False)
        N, A, L = out.labels.shape
        pos = (anchors[:, :, None] + torch.arange(L)).reshape(N, -1)
        t_hidden = t_out.hidden_states[-1].gather(1, pos[..., None].expand(-1, -1, 32)).view(N, A, L, -1) if soft else None
        if full:
            t_logits = t_out.logits.gather(1, pos[..., None].expand(-1, -1, V)).view(N, A, L, -1)
            total = draft_vocab_losses(d, adapter, out, t_logits if soft else None, 4.0, 0.5)
        else:
            total = drafter_losses(d, adapter, out, gamma=4.0, target_hidden=t_hidden, selector_alpha=0.5, chunk=7).total
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}

    d = base.with_draft_vocab(half)
    (chunked, chunked_grads), (full, full_grads) = losses(d, False), losses(d, True)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-10)
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")
    everything, plain = losses(base.with_draft_vocab(torch.arange(V)), False), losses(base, False)
    torch.testing.assert_close(everything[0], plain[0], rtol=0, atol=1e-12)
