"""Module-level properties: the dynamic convolution, candidate heads, selectors, save/load."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dflash2 import DFlash2Drafter, TargetAdapter, TorchRandom
from dflash2.config import default_target_layer_ids
from dflash2.drafter.conv import TwoTapDynamicConv
from dflash2.drafter.heads import CandidateHead
from dflash2.drafter.selectors.codebook import ViterbiSelector, viterbi_path
from dflash2.layers import SwiGLU
from tests.helpers import HAS_CXX_COMPILER, MASK, tiny_target


def perturbed_conv(H=32, B=6, taps=2, group=8, seed=0) -> TwoTapDynamicConv:
    torch.manual_seed(seed)
    conv = TwoTapDynamicConv(H, B, taps, group).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    return conv


# -- two-tap dynamic convolution -------------------------------------------------------------------
@settings(max_examples=40)
@given(taps=st.integers(1, 3), position=st.integers(0, 11), seed=st.integers(0, 10_000))
def test_conv_is_causal_inside_the_block_and_blind_across_blocks(taps, position, seed):
    B, H = 6, 32
    conv = perturbed_conv(H, B, taps, seed=seed)
    mlp = SwiGLU(H, 16).double()  # a position-wise sublayer
    x = torch.randn(2, 2 * B, H, dtype=torch.float64)  # two blocks side by side
    y = conv(x, mlp)
    x2 = x.clone()
    x2[:, position] += torch.randn(H, dtype=torch.float64)
    y2 = conv(x2, mlp)
    block_start = (position // B) * B
    unchanged = [i for i in range(2 * B) if i < position or i >= block_start + B]
    torch.testing.assert_close(y2[:, unchanged], y[:, unchanged], rtol=0, atol=0)
    assert not torch.allclose(y2[:, position], y[:, position])


def test_conv_second_tap_sees_left_neighbour():
    conv = perturbed_conv()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 2] += 1.0
    changed = (conv(x2, lambda h: h) - conv(x, lambda h: h)).abs().amax(-1)[0]
    assert changed[3] > 0 and changed[4] > 0  # pre-conv then post-conv: two hops to the right


def test_conv_is_identity_at_init():
    torch.manual_seed(0)
    conv = TwoTapDynamicConv(32, 4, 2, 16).double()
    mlp = SwiGLU(32, 16).double()
    x = torch.randn(3, 8, 32, dtype=torch.float64)
    torch.testing.assert_close(conv(x, mlp), mlp(x), rtol=0, atol=0)


def test_dflash2_at_init_equals_dflash1_with_the_same_weights():
    """Identity init means a DFlash-1 checkpoint warm-starts DFlash 2 exactly."""
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    v1 = DFlash2Drafter.from_target(target, block_size=4, conv="none", selector="argmax", num_layers=2,
                                    mask_token_id=MASK)
    v2 = DFlash2Drafter(v1.config.replace(conv="two_tap")).double()
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k for k in missing)
    adapter = TargetAdapter(target, v1.target_layer_ids)
    feats = adapter.forward(torch.tensor([[3, 4, 5, 6, 7]]), adapter.new_cache()).features
    outs = []
    for d in (v1, v2):
        cache = d.new_cache()
        d.backbone.extend_context(cache, feats)
        outs.append(d.block_hidden(cache, 9, adapter))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_conv_rejects_bad_group_size():
    with pytest.raises(ValueError, match="conv_group_size"):
        TwoTapDynamicConv(30, 4, 2, 16)


# -- candidates and selectors ------------------------------------------------------------------------
def test_candidate_head_top_k_sorted():
    logits = torch.randn(2, 5, 40)
    c = CandidateHead(7)(logits)
    assert c.ids.shape == c.scores.shape == (2, 5, 7)
    torch.testing.assert_close(c.scores, logits.gather(-1, c.ids))
    assert (c.scores[..., :-1] >= c.scores[..., 1:]).all()
    assert CandidateHead(100)(logits).ids.shape[-1] == 40


def brute_force_best(first: torch.Tensor, steps: torch.Tensor) -> float:
    K, L = first.shape[0], steps.shape[0] + 1
    best = -float("inf")
    for path in itertools.product(range(K), repeat=L):
        score = first[path[0]] + sum(steps[t - 1, path[t - 1], path[t]] for t in range(1, L))
        best = max(best, float(score))
    return best


def path_score(first, steps, path) -> float:
    return float(first[path[0]] + sum(steps[t - 1, path[t - 1], path[t]] for t in range(1, len(path))))


@settings(max_examples=200)
@given(L=st.integers(1, 5), K=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_viterbi_finds_the_maximum_score_path(L, K, seed):
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(K, generator=g, dtype=torch.float64)
    steps = torch.randn(L - 1, K, K, generator=g, dtype=torch.float64)
    path = viterbi_path(first, steps).tolist()
    assert len(path) == L
    assert path_score(first, steps, path) == pytest.approx(brute_force_best(first, steps), abs=1e-12)


def selector_drafter(kind: str, K: int = 4, zero_edges: bool = False, seed: int = 0) -> DFlash2Drafter:
    torch.manual_seed(seed)
    d = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=6, selector=kind, selector_top_k=K,
                                   selector_rank=8, mask_token_id=MASK)
    if kind != "argmax" and not zero_edges:
        torch.nn.init.normal_(d.candidate_selector.hidden_projection.weight, std=2.0)
    return d


def random_lattice(seed: int, L=5, K=4, V=48, H=32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, V, generator=g, dtype=torch.float64)
    return CandidateHead(K)(logits), torch.randn(L, H, generator=g, dtype=torch.float64)


@settings(max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), anchor=st.integers(0, 47))
@torch.no_grad()
def test_viterbi_selector_finds_the_most_probable_path(seed, anchor):
    """Probability of a path under the selector's chain model: Π_t softmax over the K successors.
    A Viterbi over raw scores (each step's normaliser ignored) fails this on most lattices."""
    cands, hidden = random_lattice(seed)
    viterbi, walk = selector_drafter("viterbi"), selector_drafter("walk")
    walk.candidate_selector.load_state_dict(viterbi.candidate_selector.state_dict())
    with torch.no_grad():
        first, steps = viterbi.candidate_selector.lattice(cands, hidden, anchor)
    first, steps = first.log_softmax(-1), steps.log_softmax(-1)
    rng = TorchRandom()
    score = lambda draft: path_score(first, steps, [int((cands.ids[t] == tok).nonzero()) for t, tok in
                                                    enumerate(draft.tokens.tolist())])
    best = score(viterbi.candidate_selector(cands, hidden, anchor, 0.0, rng))
    assert best == pytest.approx(brute_force_best(first, steps), abs=1e-9)
    assert best >= score(walk.candidate_selector(cands, hidden, anchor, 0.0, rng)) - 1e-12
    assert best >= path_score(first, steps, [0] * len(cands.ids)) - 1e-12  # the argmax path


@settings(max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), anchor=st.integers(0, 47))
def test_walk_equals_viterbi_when_edge_scores_are_zero(seed, anchor):
    cands, hidden = random_lattice(seed)
    rng = TorchRandom()
    paths = [selector_drafter(kind, zero_edges=True).candidate_selector(cands, hidden, anchor, 0.0, rng).tokens
             for kind in ("walk", "viterbi", "argmax")]
    assert torch.equal(paths[0], paths[1]) and torch.equal(paths[1], paths[2])


def test_sampled_walk_returns_the_q_it_sampled_from():
    cands, hidden = random_lattice(1)
    draft = selector_drafter("walk").candidate_selector(cands, hidden, 3, 0.8, TorchRandom(torch.Generator().manual_seed(0)))
    assert draft.stochastic and draft.q_probs.shape == draft.q_ids.shape == (5, 4)
    torch.testing.assert_close(draft.q_probs.sum(-1), torch.ones(5, dtype=torch.float64))
    for t, tok in enumerate(draft.tokens.tolist()):
        assert draft.q_probs[t][draft.q_ids[t] == tok].item() > 0
    for kind in ("viterbi", "argmax"):  # deterministic paths at any temperature
        assert not selector_drafter(kind).candidate_selector(cands, hidden, 3, 0.8, TorchRandom()).stochastic


@pytest.mark.parametrize("rows", [1, 3])
def test_sliced_hidden_states_score_like_their_rows(rows):
    """lm_logits and the selector's edge scores take [..., H] slices of a block (hidden[:, 1:L+1], whose
    strides are the block's) as plain 2-d rows, because oneDNN's half-precision matmul is many times
    slower on such 3-d inputs: shapes and values must be those of each row scored on its own."""
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target)
    drafter = DFlash2Drafter.from_target(target, block_size=6, mask_token_id=MASK).to(torch.bfloat16)
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_()
    block = torch.randn(rows, 6, adapter.hidden_size).to(torch.bfloat16)  # [R, B, H]
    hidden = block[:, 1:5]  # [R, 4, H], strided like the block
    logits = adapter.lm_logits(hidden)
    assert logits.shape == (rows, 4, adapter.vocab_size) and logits.dtype == torch.bfloat16
    for r in range(rows):
        torch.testing.assert_close(logits[r], adapter.lm_logits(hidden[r].clone()))
    ids = torch.randint(0, adapter.vocab_size, (rows, 4, 3))
    edges = drafter.candidate_selector.edge_scores(ids, hidden, ids)
    assert edges.shape == (rows, 4, 3, 3)
    for r in range(rows):
        torch.testing.assert_close(edges[r], drafter.candidate_selector.edge_scores(ids[r], hidden[r].clone(), ids[r]))
    assert adapter.lm_logits(block[:, 1:1]).shape == (rows, 0, adapter.vocab_size)  # an empty slice


@pytest.mark.parametrize("conv", ["two_tap", "none"])
def test_backbone_rows_gives_the_first_rows_of_the_whole_block(conv):
    """backbone(..., rows=r) runs the last layer on the first r positions only: its outputs must be
    those of the whole block, with a batch, a padding mask and per-row positions (float64)."""
    target = tiny_target("qwen3")
    torch.manual_seed(3)
    d = DFlash2Drafter.from_target(target, block_size=6, conv=conv, num_layers=2, mask_token_id=MASK)
    for layer in d.backbone.layers:
        for c in (layer.attention_conv, layer.mlp_conv):
            for p in c.parameters():
                torch.nn.init.normal_(p)
    N, B, C, H = 2, 6, 5, d.config.hidden_size
    kv = (N, d.config.num_key_value_heads, C, d.config.head_dim)
    context = [(torch.randn(kv, dtype=torch.float64), torch.randn(kv, dtype=torch.float64)) for _ in range(2)]
    mask = torch.ones(N, 1, B, C + B, dtype=torch.bool)
    mask[1, :, :, :2] = False  # row 1's context is left-padded
    x = torch.randn(N, B, H, dtype=torch.float64)
    positions = torch.tensor([[5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8]])
    whole = d.backbone(x, positions, context, mask)
    for rows in range(1, B + 1):
        torch.testing.assert_close(d.backbone(x, positions, context, mask, rows=rows), whole[:, :rows])
    with pytest.raises(ValueError, match="rows"):
        d.backbone(x, positions, context, mask, rows=0)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("layout", [{}, {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 4}],
                         ids=["full", "sliding-causal-W4"])
def test_compiled_backbone_drafts_what_the_eager_one_does(layout):
    """backbone.compile() compiles the block pass and the context projection; over growing contexts
    (dynamic shapes) both must match eager, with the published layouts' masks too. (The quick bench
    test decodes with compiled drafters.)"""
    target = copy.deepcopy(tiny_target("qwen3")).float()  # the cached float64 target must stay as it is
    torch.manual_seed(4)
    eager = DFlash2Drafter.from_target(target, block_size=6, num_layers=2, mask_token_id=MASK,
                                       **layout).float().eval()
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fast = DFlash2Drafter(eager.config).float().eval()
    fast.load_state_dict(eager.state_dict())
    fast.backbone.compile(dynamic=True)
    assert "context_kv" in vars(fast.backbone)  # the compiled projection shadows the method
    adapter = TargetAdapter(target, eager.target_layer_ids)
    caches = [eager.new_cache(), fast.new_cache()]
    with torch.no_grad():
        # a prompt, then rounds of different lengths: one compilation of each path (a round of 1 position,
        # or a block pass over the prompt's not yet concatenated context, would add one each)
        for i, n in enumerate((7, 3, 2, 4)):
            features = torch.randn(1, n, len(eager.target_layer_ids) * eager.config.hidden_size)
            for d, c in zip((eager, fast), caches):
                d.backbone.extend_context(c, features)
            for (ke, ve), (kf, vf) in zip(zip(caches[0].keys, caches[0].values), zip(caches[1].keys, caches[1].values)):
                torch.testing.assert_close(kf, ke, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(vf, ve, atol=1e-5, rtol=1e-5)
            if i:
                torch.testing.assert_close(fast.block_hidden(caches[1], 5, adapter, rows=4),
                                           eager.block_hidden(caches[0], 5, adapter, rows=4), atol=1e-5, rtol=1e-5)


ROUND_VARIANTS = {"full": {}, "sliding-causal-W4": {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 4},
                  "context-window-7": {"context_window": 7}, "draft-vocab": {}}


@pytest.mark.parametrize("variant", list(ROUND_VARIANTS))
def test_a_drafting_round_is_the_block_pass_then_candidates_then_the_lattice(variant):
    """draft_round (what propose and propose_tree call: one function, one graph when compiled) must
    give what the step-by-step path gives: extend_context, the block's hidden states (block_hidden,
    checked against the published reference elsewhere), the LM head's top-K, the selector's lattice;
    and keep the same context, trimmed to a window when one applies. Over growing contexts from an
    empty cache, with sliding layers, a context window and a draft vocabulary."""
    target = tiny_target("qwen3")
    torch.manual_seed(5)
    d = DFlash2Drafter.from_target(target, block_size=6, num_layers=2, mask_token_id=MASK, selector_top_k=4,
                                   **ROUND_VARIANTS[variant])
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if variant == "draft-vocab":
        d = d.with_draft_vocab(torch.arange(1, d.config.vocab_size, 3))
    adapter = TargetAdapter(target, d.target_layer_ids)
    by_round, by_steps = d.new_cache(), d.new_cache()
    with torch.no_grad():
        for n, anchor in ((7, 5), (3, 9), (1, 2), (4, 5)):
            features = torch.randn(1, n, len(d.target_layer_ids) * d.config.hidden_size, dtype=torch.float64)
            s = d.draft_round(by_round, anchor, features, adapter)
            d.backbone.extend_context(by_steps, features)
            hidden = d.block_hidden(by_steps, anchor, adapter, rows=d.config.num_draft_positions + 1)[0, 1:]  # [L, H]
            cands = d.draft_candidates(hidden, adapter)
            first, steps = d.candidate_selector.lattice(cands, hidden, anchor)
            assert by_round.length == by_steps.length
            for a, b in zip(by_round.keys + by_round.values, by_steps.keys + by_steps.values):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
            torch.testing.assert_close(s.hidden, hidden, atol=1e-12, rtol=0)
            assert torch.equal(s.cands.ids, cands.ids)
            for a, b in ((s.cands.scores, cands.scores), (s.first, first), (s.steps, steps)):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("variant", ["full", pytest.param("context-window-7", marks=pytest.mark.slow)])
def test_a_compiled_drafting_round_drafts_what_the_eager_one_does(variant):
    """drafter.compile() runs each batch-1 round as one graph (dynamic shapes: the context grows, a
    first round starts from an empty cache, a window trims the context): its scores, its cache and
    the paths it proposes must be the eager drafter's. (The quick bench test decodes trees with a
    compiled drafter.)"""
    target = copy.deepcopy(tiny_target("qwen3")).float()  # the cached float64 target must stay as it is
    torch.manual_seed(6)
    eager = DFlash2Drafter.from_target(target, block_size=6, num_layers=2, mask_token_id=MASK, selector_top_k=4,
                                       **ROUND_VARIANTS[variant]).float().eval()
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fast = copy.deepcopy(eager)
    fast.compile(dynamic=True)
    adapter = TargetAdapter(target, eager.target_layer_ids)
    caches = [eager.new_cache(), fast.new_cache()]
    rng = TorchRandom(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, (n, anchor) in enumerate(((7, 5), (3, 9), (2, 2), (4, 5), (5, 7))):
            features = torch.randn(1, n, len(eager.target_layer_ids) * eager.config.hidden_size)
            if i % 2:  # the paths of propose (the walk: no lattice in the graph)
                paths = [d.propose(c, anchor, features, adapter, 0.0, rng).tokens for d, c in zip((eager, fast), caches)]
                assert torch.equal(*paths)
            else:  # the scores propose_tree grows its tree from
                s_eager, s_fast = (d.draft_round(c, anchor, features, adapter) for d, c in zip((eager, fast), caches))
                assert torch.equal(s_fast.cands.ids, s_eager.cands.ids)
                torch.testing.assert_close(s_fast.hidden, s_eager.hidden, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(s_fast.steps, s_eager.steps, atol=1e-4, rtol=1e-4)
            assert caches[0].length == caches[1].length
            for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_a_compiled_drafter_compiles_only_while_warming_up():
    """The warm-up before a compiled drafter's first round compiles every graph its rounds need: decodes
    greedy and sampled (rounds that read one feature, after a rejection, and several), paths and trees,
    short and long prompts, compile nothing more. A graph compiled inside a decode would land in a timed
    run (a sampled decode's first round over one feature did), and each graph more is a guard check
    more on every round."""
    from dflash2 import spec_generate

    target = copy.deepcopy(tiny_target("qwen3", vocab=5)).float()  # a vocabulary of 5: chance acceptances
    torch.manual_seed(7)
    drafter = DFlash2Drafter.from_target(target, block_size=6, num_layers=2, mask_token_id=4,
                                         selector_top_k=3).float().eval()
    drafter.compile(dynamic=True)
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    width = len(drafter.target_layer_ids) * target.config.hidden_size
    with torch.no_grad():
        for lattice in (True, False):
            drafter.warm_up(adapter, torch.zeros(1, 1, width), lattice)
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    before = graphs()
    g = torch.Generator().manual_seed(3)
    rounds = []
    for length in (1, 2, 9):
        prompt = torch.randint(0, 4, (1, length), generator=g)
        for temperature in (0.0, 1.0):
            for verify in ("path", "tree"):
                out = spec_generate(drafter, adapter, prompt, max_new_tokens=16, temperature=temperature, verify=verify,
                                    tree_nodes=5, generator=g)
                rounds += out.acceptance_lengths
    assert 1 in rounds and max(rounds) > 2  # rounds after a rejection (one feature) and after acceptances
    assert graphs() == before


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_a_compiled_batched_round_drafts_what_the_eager_one_does_and_compiles_only_while_warming_up():
    """drafter.compile() also runs the batched round (propose_batch, propose_tree_batch) as one graph:
    over rows that join, grow by different amounts, leave down to one row, and a context window, its
    scores and paths must be the eager drafter's; after its warm-up, batched decodes (paths and trees,
    greedy and sampled, rows finishing one by one) compile nothing more."""
    from dflash2 import spec_generate_batch

    target = copy.deepcopy(tiny_target("qwen3", vocab=5)).float()  # a vocabulary of 5: chance acceptances
    torch.manual_seed(8)
    eager = DFlash2Drafter.from_target(target, block_size=6, num_layers=2, mask_token_id=4, selector_top_k=3,
                                       context_window=9).float().eval()
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fast = copy.deepcopy(eager)
    fast.compile(dynamic=True)
    adapter = TargetAdapter(target, eager.target_layer_ids)
    g = torch.Generator().manual_seed(1)
    F = len(eager.target_layer_ids) * eager.config.hidden_size
    contexts = [eager.new_context_batch(), fast.new_context_batch()]
    rng = TorchRandom(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rnd, (joining, leaving) in enumerate(((3, None), (0, None), (1, 1), (0, 0), (0, None), (0, 1))):
            for c in contexts:
                if joining:
                    c.add_rows(joining)
                if leaving is not None:
                    c.select_rows([i for i in range(len(c.lengths)) if i != leaving])
            news = [torch.randn(1, int(torch.randint(1, 11 if n == 0 else 5, (1,), generator=g)), F, generator=g)
                    for n in contexts[0].lengths]
            anchors = [int(a) for a in torch.randint(0, 4, (len(news),), generator=g)]
            if rnd % 2:  # the paths of propose_batch (the walk: no lattice in the graph)
                paths = [d.propose_batch(c, anchors, news, adapter, 0.0, rng) for d, c in zip((eager, fast), contexts)]
                assert [p.tokens.tolist() for p in paths[0]] == [p.tokens.tolist() for p in paths[1]]
            else:  # the scores propose_tree_batch grows its trees from
                for d, c in zip((eager, fast), contexts):
                    d.backbone.extend_batch(c, news, d.config.block_size)
                s_eager, s_fast = (d.draft_round_batch(c, anchors, news, adapter, 4) for d, c in zip((eager, fast), contexts))
                assert s_fast.hidden.shape == (len(anchors), 4, eager.config.hidden_size)
                assert torch.equal(s_fast.cands.ids, s_eager.cands.ids)
                torch.testing.assert_close(s_fast.hidden, s_eager.hidden, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(s_fast.first, s_eager.first, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(s_fast.steps, s_eager.steps, atol=1e-4, rtol=1e-4)
        graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
        before = graphs()
        prompts = torch.randint(0, 4, (5, 9), generator=g)
        mask = torch.ones_like(prompts)
        mask[1, :8] = mask[3, :4] = 0  # a one-token prompt among them
        for temperature in (0.0, 1.0):
            for verify in ("path", "tree"):
                spec_generate_batch(fast, adapter, prompts, mask, max_new_tokens=12, temperature=temperature,
                                    verify=verify, tree_nodes=5, concurrency=3, generator=g)
    assert graphs() == before


@pytest.mark.parametrize("window", [None, 5])
def test_context_batch_follows_each_row_across_rounds(window):
    """One ContextBatch for rows that join late, grow by different amounts each round and leave: the
    batched pass gives every row the hidden states and candidates its own ContextCache gives (float64),
    with and without a context window, while the buffers grow past their first capacity."""
    target = tiny_target("qwen3")
    torch.manual_seed(3)
    d = DFlash2Drafter.from_target(target, block_size=4, conv="two_tap", num_layers=2, mask_token_id=MASK,
                                   selector_top_k=3, context_window=window)
    for layer in d.backbone.layers:
        for c in (layer.attention_conv, layer.mlp_conv):
            torch.nn.init.normal_(c.kernel_projection.weight, std=0.3)
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    F = len(d.target_layer_ids) * d.config.hidden_size
    features = lambda n: torch.randn(1, n, F, generator=g, dtype=torch.float64)  # noqa: E731
    context, rows, capacities = d.new_context_batch(), [], set()  # rows[i]: row i's own ContextCache
    for rnd in range(8):
        if rnd in (0, 2, 5):  # newcomers join with their prompt's features
            context.add_rows(2 if rnd != 5 else 1)
            rows += [d.new_cache() for _ in range(2 if rnd != 5 else 1)]
            news = [features(int(torch.randint(1, 13, (1,), generator=g))) if c.length == 0
                    else features(int(torch.randint(1, 5, (1,), generator=g))) for c in rows]
        else:
            news = [features(int(torch.randint(1, 5, (1,), generator=g))) for _ in rows]
        if rnd in (3, 6):  # the second row finishes and leaves
            context.select_rows([i for i in range(len(rows)) if i != 1])
            rows, news = rows[:1] + rows[2:], news[:1] + news[2:]
        d.backbone.extend_batch(context, news, d.config.block_size)
        for cache, f in zip(rows, news):
            d.backbone.extend_context(cache, f)
        assert context.lengths == [c.length for c in rows]
        capacities.add(context.keys[0].shape[2])
        anchors = [int(a) for a in torch.randint(0, MASK, (len(rows),), generator=g)]
        s = d.draft_round_batch(context, anchors, None, adapter, 3, lattice=False)
        hidden, cands = s.hidden, s.cands
        for i, (cache, anchor) in enumerate(zip(rows, anchors)):
            alone_hidden = d.block_hidden(cache, anchor, adapter, rows=4)[0, 1:]  # [3, H]
            alone = d.draft_candidates(alone_hidden, adapter)
            torch.testing.assert_close(hidden[i], alone_hidden, rtol=0, atol=1e-10)
            assert cands.ids[i].tolist() == alone.ids.tolist()
    assert len(capacities) > 1  # the buffers grew while rows were in flight


# -- configs, from_target, save/load -------------------------------------------------------------------
def test_default_target_layer_ids_match_the_reference():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B-DFlash
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(4) == (0, 2, 3)


def test_from_target_reads_sizes_from_the_target():
    target = tiny_target("gpt2")
    d = DFlash2Drafter.from_target(target, block_size=8)
    c = d.config
    assert (c.hidden_size, c.vocab_size, c.num_target_layers) == (32, 48, 4)
    assert next(d.parameters()).dtype == torch.float64
    assert not any("embed" in k or "lm_head" in k for k in d.state_dict())


VARIANTS = [dict(conv=c, selector=s) for c in ("two_tap", "none") for s in ("walk", "viterbi", "argmax")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v['conv']}-{v['selector']}")
def test_save_load_round_trip(variant, tmp_path):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(target, block_size=5, num_layers=2, selector_top_k=4, selector_rank=8,
                                   mask_token_id=MASK, context_window=9, **variant)
    for p in d.parameters():  # move away from init so the round trip is not trivially true
        torch.nn.init.normal_(p, std=0.2)
    d.save_pretrained(tmp_path)
    e = DFlash2Drafter.from_pretrained(tmp_path)
    assert e.config == d.config
    assert d.state_dict().keys() == e.state_dict().keys()
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]) and v.dtype == e.state_dict()[k].dtype
    adapter = TargetAdapter(target, d.target_layer_ids)
    feats = adapter.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), adapter.new_cache()).features
    drafts = []
    for m in (d, e):
        drafts.append(m.propose(m.new_cache(), 4, feats, adapter, 0.7, TorchRandom(torch.Generator().manual_seed(5))))
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)


def test_from_pretrained_is_strict(tmp_path):
    d = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=4, mask_token_id=MASK)
    d.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    extra = dict(state, **{"stray.weight": torch.zeros(1)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected"):
        DFlash2Drafter.from_pretrained(tmp_path)
    state.pop("backbone.fc.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        DFlash2Drafter.from_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["block_sise"] = 3
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="block_sise"):
        DFlash2Drafter.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        DFlash2Drafter.from_pretrained(tmp_path / "nope")


def test_with_config_shares_weights_and_ablates_the_selector():
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(target, block_size=8, selector="walk", selector_top_k=4, selector_rank=8,
                                   mask_token_id=MASK, num_layers=1)
    smaller = d.with_config(block_size=4, selector="viterbi")
    assert smaller.config.block_size == 4 and isinstance(smaller.candidate_selector, ViterbiSelector)
    assert all(torch.equal(a, b) for a, b in zip(smaller.state_dict().values(), d.state_dict().values()))
    plain = d.with_config(selector="argmax")  # the selector ablation: same backbone, no codebooks
    assert not any(k.startswith("candidate_selector.") for k in plain.state_dict())
    assert all(torch.equal(v, d.state_dict()[k]) for k, v in plain.state_dict().items())
    with pytest.raises(ValueError, match="needs trained parameters .*codebook"):
        plain.with_config(selector="walk")


@pytest.mark.parametrize("conv", ["two_tap", "none"])
def test_grown_drafter_drafts_exactly_what_it_grew_from_and_its_new_layer_learns(conv):
    """grown(n): the old layers first, then identity layers (zero output projections), so the draft
    logits are equal to the last bit; the new layer's output projections still get gradients."""
    target = tiny_target("qwen3")
    torch.manual_seed(2)
    d = DFlash2Drafter.from_target(target, block_size=6, conv=conv, selector="argmax", mask_token_id=MASK,
                                   num_layers=2)
    for p in d.parameters():  # every weight random, the convs' kernel maps included (identity at init)
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    adapter = TargetAdapter(target, d.target_layer_ids)
    g = d.grown(3)
    assert g.config.num_layers == 3 and len(g.backbone.layers) == 3
    for prompt in ([5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2]):
        features = adapter.forward(torch.tensor([prompt]), adapter.new_cache()).features
        logits = []
        for m in (d, g):
            cache = m.new_cache()
            m.backbone.extend_context(cache, features)
            logits.append(m.draft_logits(m.block_hidden(cache, 4, adapter), adapter))
        assert torch.equal(logits[0], logits[1])
    new = g.backbone.layers[2]
    outputs = (new.self_attn.o_proj.weight, new.mlp.down_proj.weight)  # autograd.grad: the shared target keeps no .grad
    assert all(grad.abs().sum() > 0 for grad in torch.autograd.grad(logits[1].logsumexp(-1).sum(), outputs))
    assert not torch.equal(g.backbone.layers[0].self_attn.q_proj.weight, new.self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="cannot grow"):
        d.grown(1)


@pytest.mark.parametrize("selector", ["walk", "argmax"])
def test_draft_len_proposes_a_prefix_of_the_full_block(selector):
    """draft_len n: the drafter still runs its whole block, so the greedy walk and top-1 propose the
    first n tokens of what they propose without it (alone and batched); the verifier sees n tokens."""
    target = tiny_target("qwen3")
    torch.manual_seed(1)
    d = DFlash2Drafter.from_target(target, block_size=8, selector=selector, selector_top_k=4, selector_rank=8,
                                   mask_token_id=MASK, num_layers=2)
    if selector == "walk":
        torch.nn.init.normal_(d.candidate_selector.hidden_projection.weight, std=2.0)
    adapter = TargetAdapter(target, d.target_layer_ids)
    features = [adapter.forward(torch.tensor([p]), adapter.new_cache()).features for p in ([5, 9, 2, 7], [3, 1])]
    rng = TorchRandom(torch.Generator().manual_seed(0))
    full = [d.propose(d.new_cache(), 4, f, adapter, 0.0, rng).tokens for f in features]
    short = d.with_config(draft_len=3)
    alone = [short.propose(short.new_cache(), 4, f, adapter, 0.0, rng).tokens for f in features]
    context = short.new_context_batch()
    context.add_rows(2)
    batch = [x.tokens for x in short.propose_batch(context, [4, 4], features, adapter, 0.0, rng)]
    assert all(len(f) == 7 for f in full)
    for f, a, b in zip(full, alone, batch):
        assert a.tolist() == b.tolist() == f[:3].tolist()
    assert d.with_config(draft_len=99).config.num_draft_positions == 7
    with pytest.raises(ValueError, match="draft_len"):
        d.with_config(draft_len=0)


@pytest.mark.skipif(not HAS_CXX_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
def test_compile_own_keeps_each_instances_graphs_apart():
    """Two instances of a class compile the same method, whose branch differs between them: through
    torch.compile both graphs sit on the one shared code object, so every call checks the other's guards
    too; through compile_own each instance's code holds its own graph only, and computes what the eager
    method does."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflash2.compile import compile_own

    class Step:
        def __init__(self, double: bool) -> None:
            self.double = double

        def step(self, x):
            return x * 2 + 1 if self.double else x - 1

    x = torch.randn(3)
    for double in (True, False):
        torch.compile(Step(double).step, dynamic=True)(x)
    assert len(_debug_get_cache_entry_list(Step.step.__code__)) == 2
    for double in (True, False):
        fn = compile_own(Step(double).step, dynamic=True)
        torch.testing.assert_close(fn(x), x * 2 + 1 if double else x - 1)
        code = fn._torchdynamo_orig_callable.__func__.__code__
        assert code is not Step.step.__code__ and len(_debug_get_cache_entry_list(code)) == 1
