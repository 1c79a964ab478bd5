"""Batched decoding is lossless per row.

* greedy: every row of a Hypothesis-drawn batch of ragged (left-padded) prompts equals HF generate
  on that row alone, with drafters whose acceptance differs between rows and rounds;
* sampling: the exact joint distribution of a 2-row batch, enumerated over every random branch of
  the real `spec_generate_batch`, is the product of the rows' AR distributions;
* finished rows leave the batch: the target's passes shrink as rows stop.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2 import DFlash2Drafter, Draft, SamplingParams, TargetAdapter, ar_generate_batch, spec_generate, spec_generate_batch
from dflash2.decoding.batch import PREFILL_PADDING, left_pad, prefill_groups
from dflash2.decoding.sampling import process_logits
from dflash2.targets.static import StaticTarget
from tests.helpers import (ARCHITECTURES, HYBRID_ARCHITECTURES, VOCAB, DraftEvery, enumerate_outcomes,
                           exact_ar_distribution, hf_greedy, max_abs_diff, needs_hybrid_transformers,
                           oracle_tree_drafter, perturb_selector, tiny_drafter, tiny_target)


class RowOracle:
    """A drafter that copies each row's greedy continuation, with every corrupt_every-th drafted
    token wrong (a different period per row, so rows accept different lengths). `new_cache` is
    called once per row, in row order: the cache remembers which row it serves."""

    def __init__(self, block_size: int, references: list[list[int]], corrupt: list[int]) -> None:
        self.block_size, self.refs, self.corrupt = block_size, references, corrupt
        self.target_layer_ids: tuple[int, ...] = (0,)
        self._rows = 0

    def new_cache(self) -> dict:
        self._rows += 1
        return {"row": self._rows - 1, "position": 0}

    def propose(self, cache, anchor, new_features, target, temperature, rng) -> Draft:
        cache["position"] += new_features.shape[1]
        ref, every, pos = self.refs[cache["row"]], self.corrupt[cache["row"]], cache["position"]
        out = []
        for j in range(1, self.block_size):
            tok = ref[pos + j] if pos + j < len(ref) else 0
            if every and (pos + j) % every == 0:
                tok = (tok + 1) % VOCAB
            out.append(tok)
        return Draft(torch.tensor(out, dtype=torch.long))


def dflash_drafter(arch: str, block_size: int) -> DFlash2Drafter:
    return tiny_drafter(arch, block_size, seed=block_size, selector_top_k=3, selector_rank=8, mask_token_id=VOCAB - 1,
                        num_layers=1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=12, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=9), min_size=1, max_size=4),
       block_size=st.integers(1, 8), budget=st.integers(0, 16), kind=st.sampled_from(["oracle", "dflash", "ar"]),
       concurrency=st.none() | st.integers(1, 3), data=st.data())
def test_batched_greedy_equals_each_row_alone(arch, prompts, block_size, budget, kind, concurrency, data):
    target = tiny_target(arch)
    refs = [hf_greedy(target, p, max(budget, 1)) for p in prompts]
    stop = data.draw(st.none() | st.sampled_from(refs[0][len(prompts[0]):]), label="stop token")
    stops = [stop] if stop is not None else None
    expected = [hf_greedy(target, p, budget, stops) if budget > 0 else p for p in prompts]
    ids, mask = left_pad(prompts)
    if kind == "ar":
        results = ar_generate_batch(target, ids, mask, max_new_tokens=budget, stop_token_ids=stops,
                                    concurrency=concurrency)
    else:
        drafter = (RowOracle(block_size, refs, [3 + r for r in range(len(prompts))]) if kind == "oracle"
                   else dflash_drafter(arch, block_size))
        results = spec_generate_batch(drafter, target, ids, mask, max_new_tokens=budget, stop_token_ids=stops,
                                      concurrency=concurrency)
    assert [r.sequences[0].tolist() for r in results] == expected
    for r, p in zip(results, prompts):
        assert r.prompt_length == len(p)
        assert all(1 <= n <= block_size for n in r.acceptance_lengths)
        if budget > 0:
            assert r.new_tokens.numel() == 1 + sum(r.acceptance_lengths)
        assert (r.finish_reason == "stop") == (stop is not None and stop in r.new_tokens.tolist())


def test_rows_accept_different_lengths_and_finished_rows_leave():
    """Mixed per-row acceptance really happens, and the batch shrinks as rows stop."""
    target = tiny_target("qwen3")
    prompts = [[5, 9, 2, 7], [1], [3, 3, 3, 3, 3, 3, 8]]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    stop = refs[1][len(prompts[1]) + 4]  # row 1 stops early (unless the token comes sooner elsewhere)
    expected = [hf_greedy(target, p, 30, [stop]) for p in prompts]
    adapter = TargetAdapter(target, (0,))
    widths, prefilled = [], []  # the rows of every decoding pass; of every prefill (its keys: its own tokens)
    forward = adapter.forward_masked
    adapter.forward_masked = lambda ids, q, k, *a, **kw: \
        (widths if k.shape[1] > q.shape[1] else prefilled).append(ids.shape[0]) or forward(ids, q, k, *a, **kw)
    results = spec_generate_batch(RowOracle(6, refs, [3, 4, 0]), adapter, *left_pad(prompts), max_new_tokens=30,
                                  stop_token_ids=[stop])
    assert [r.sequences[0].tolist() for r in results] == expected
    assert results[2].acceptance_lengths[0] == 6 and min(results[0].acceptance_lengths) < 6
    assert sum(prefilled) == 3 and widths[-1] < widths[0] <= 3, widths  # rows that finished left the batch
    assert widths == sorted(widths, reverse=True)


@pytest.mark.parametrize("step", ["adapter", "static"])
@pytest.mark.parametrize("loop", ["batch", "one row"])
def test_rows_read_their_own_features_after_rounds_that_do_not_draft(step, loop):
    """Rounds a policy does not draft are plain steps for every row; each row keeps its features for
    the next round that drafts. Whatever the skipped stretches, a row's drafter reads exactly its own
    sequence's target features, in order, each once (against a forward over the row alone), the
    accepted drafts' among them; a row given another row's features, one feature twice or an accepted
    token's left out fails here (greedy outputs cannot show it: they are lossless whatever the drafter
    reads). "one row": spec_generate, each prompt alone."""
    target = tiny_target("qwen3")
    prompts = [[5, 9, 2, 7], [1, 4], [3, 3, 3, 3, 3, 3, 8]]
    refs = [hf_greedy(target, p, 24) for p in prompts]
    corrupt = [3, 4, 0]
    read: dict[int, list[torch.Tensor]] = {}

    class Recording(RowOracle):
        def __init__(self, *args, rows: list[int]) -> None:
            super().__init__(*args)
            self.row_ids = rows  # the prompt each new cache serves

        def propose(self, cache, anchor, new_features, target, temperature, rng) -> Draft:
            read.setdefault(self.row_ids[cache["row"]], []).append(new_features)
            return super().propose(cache, anchor, new_features, target, temperature, rng)

    adapter = TargetAdapter(target, (0,))
    tgt = adapter if step == "adapter" else StaticTarget(target, (0,))
    if loop == "batch":
        results = spec_generate_batch(Recording(5, refs, corrupt, rows=[0, 1, 2]), tgt, *left_pad(prompts),
                                      max_new_tokens=24, policy=DraftEvery(3), concurrency=2)
    else:
        results = [spec_generate(Recording(5, [refs[r]], [corrupt[r]], rows=[r]), tgt, torch.tensor([p]),
                                 max_new_tokens=24, policy=DraftEvery(3)) for r, p in enumerate(prompts)]
    assert any(n > 1 for r in results for n in r.acceptance_lengths)  # drafts accepted: their features count
    for row, r in enumerate(results):
        got = torch.cat(read[row], dim=1)  # [1, n, F]: every feature the row's drafter read
        assert len(read[row]) > 2 and got.shape[1] > len(prompts[row]) + 4  # several stretches, skipped rounds among them
        want = adapter.forward(r.sequences[:, : got.shape[1]], adapter.new_cache()).features
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_prefill_groups_cover_every_newcomer_within_the_padding_bound(lengths):
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * longest <= PREFILL_PADDING * sum(lengths[i] for i in g)
    assert len(prefill_groups([100] * 8)) == 1 and len(prefill_groups([200, 10])) == 2


def test_continuous_batching_admits_waiting_rows_as_others_finish():
    """With concurrency 2, at most 2 rows are in flight; a finished row's place goes to the next
    waiting prompt at once, whose cache joins the running batch; every row still equals HF greedy."""
    target = tiny_target("qwen3")
    prompts = [[5, 9, 2, 7], [1], [3, 3, 3, 3, 3, 3, 8], [4, 2], [6, 6, 1, 2, 3]]
    refs = [hf_greedy(target, p, 30) for p in prompts]
    stop = refs[1][len(prompts[1]) + 4]
    expected = [hf_greedy(target, p, 30, [stop]) for p in prompts]
    adapter = TargetAdapter(target, (0,))
    passes = []  # (rows, is prefill) of every target pass
    forward = adapter.forward_masked
    adapter.forward_masked = lambda ids, q, k, allowed, c, **kw: passes.append(
        (ids.shape[0], bool((q == k[:, -q.shape[1]:]).all() and k.shape[1] == q.shape[1]))) or \
        forward(ids, q, k, allowed, c, **kw)
    results = spec_generate_batch(RowOracle(6, refs, [3, 4, 0, 5, 2]), adapter, *left_pad(prompts),
                                  max_new_tokens=30, stop_token_ids=[stop], concurrency=2)
    assert [r.sequences[0].tolist() for r in results] == expected
    prefills = [rows for rows, prefill in passes if prefill]
    last_admission = max(i for i, (_, prefill) in enumerate(passes) if prefill)
    assert sum(prefills) == len(prompts) and max(prefills) <= 2  # two at first, then newcomers as rows finish
    assert all(rows == 2 for rows, prefill in passes[:last_admission] if not prefill), passes  # the batch stays full
    drain = [rows for rows, _ in passes[last_admission + 1:]]
    assert drain[0] == 2 and drain == sorted(drain, reverse=True)  # then it drains
    with pytest.raises(ValueError, match="concurrency"):
        spec_generate_batch(RowOracle(6, refs, [3] * 5), adapter, *left_pad(prompts), max_new_tokens=3, concurrency=0)


# -- exact joint distribution of a 2-row batch ----------------------------------------------------------
V, PROMPTS, N_NEW = 3, ([1, 2], [2]), 3


@functools.lru_cache(maxsize=None)
def small_target():
    return tiny_target("qwen3", vocab=V, seed=3)


def small_drafter(selector: str) -> DFlash2Drafter:
    # the walk with a non-trivial pairwise term: the sampled walk's q depends on its path
    return tiny_drafter("qwen3", 3, seed=11, vocab=V, target_seed=3, pairwise_std=3.0 if selector == "walk" else 0.0,
                        selector=selector, selector_top_k=2, selector_rank=4, mask_token_id=V - 1)


# the sampled walk (sparse stochastic q) at top-k 2; a deterministic path (one-hot q) at T=1
# concurrency 1: the second row is admitted only when the first finishes
# verify="tree": each row walks its own 3-node tree, one decision per node with the residual rule
# static: the same through StaticTarget's batched step (the written-out layers over preallocated buffers)
# (concurrency 1 through the HF step repeats the static one's admission order: -m slow)
@pytest.mark.parametrize("selector,params,concurrency,verify,step", [
    ("walk", SamplingParams(0.8, top_k=2), None, "path", "hf"),
    ("argmax", SamplingParams(1.0), None, "path", "hf"),
    pytest.param("argmax", SamplingParams(1.0), 1, "path", "hf", marks=pytest.mark.slow),
    ("walk", SamplingParams(0.8, top_k=2), None, "tree", "hf"),
    ("argmax", SamplingParams(1.0), None, "tree", "hf"),
    ("argmax", SamplingParams(1.0), 1, "path", "static"),
    ("walk", SamplingParams(0.8, top_k=2), None, "tree", "static")],
    ids=["walk_T0.8_topk2", "argmax_T1", "argmax_T1_concurrency1", "tree_walk_T0.8_topk2", "tree_argmax_T1",
         "static_argmax_T1_concurrency1", "static_tree_walk_T0.8_topk2"])
def test_batched_sampling_is_exact_per_row(selector, params, concurrency, verify, step):
    drafter, lengths = small_drafter(selector), set()
    target = small_target() if step == "hf" else StaticTarget(small_target(), drafter.target_layer_ids)

    def program(rng):
        results = spec_generate_batch(drafter, target, *left_pad(list(PROMPTS)), max_new_tokens=N_NEW,
                                      temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, rng=rng,
                                      concurrency=concurrency, verify=verify, tree_nodes=3)
        for r in results:
            lengths.update(r.acceptance_lengths)
        return tuple(tuple(r.new_tokens.tolist()) for r in results)

    got, branches = enumerate_outcomes(program)
    rows = [exact_ar_distribution(small_target(), p, N_NEW, lambda logits: process_logits(logits, params))
            for p in PROMPTS]
    expected = {(a, b): pa * pb for a, pa in rows[0].items() for b, pb in rows[1].items()}
    print(f"batch-{verify}-{selector} T{params.temperature}/k{params.top_k}: {branches} branches, "
          f"acceptance lengths {sorted(lengths)}")
    assert max(lengths) > 1
    assert max_abs_diff(got, expected) < 1e-12


# -- errors -----------------------------------------------------------------------------------------
def test_batch_errors():
    target = tiny_target("qwen3")
    d = dflash_drafter("qwen3", 4)
    with pytest.raises(ValueError, match="left padding"):
        spec_generate_batch(d, target, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 1], [1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="shape"):
        spec_generate_batch(d, target, torch.tensor([[1, 2]]), torch.tensor([[1, 1, 1]]), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"\[N, T\]"):
        spec_generate_batch(d, target, torch.tensor([1, 2]), max_new_tokens=2)


@needs_hybrid_transformers
def test_batches_refused_on_hybrid_targets():
    hybrid = tiny_target(next(iter(HYBRID_ARCHITECTURES)))
    with pytest.raises(ValueError, match="attention-only"):
        ar_generate_batch(hybrid, torch.tensor([[1, 2]]), max_new_tokens=2)


@pytest.mark.parametrize("selector", ["argmax", "walk", "viterbi", "dspark", "lilicorr"])
def test_propose_batch_equals_propose_per_row(selector):
    """The drafter's batched pass (the rows' contexts in one ContextBatch, masked) drafts what each row drafts alone."""
    from dflash2 import TorchRandom
    from dflash2.drafter.model import DFlash2Drafter

    target = tiny_target("llama")
    torch.manual_seed(5)
    d = DFlash2Drafter.from_target(target, block_size=6, selector=selector, selector_top_k=4, selector_rank=8,
                                   mask_token_id=VOCAB - 1, num_layers=2, context_window=7,
                                   confidence_head=selector == "dspark")
    perturb_selector(d, 2.0)
    adapter = TargetAdapter(target, d.target_layer_ids)
    prompts = [[5, 9, 2, 7, 1, 1, 3, 4, 8, 2], [1], [3, 3, 8]]
    feats = [adapter.forward(torch.tensor([p]), adapter.new_cache()).features for p in prompts]
    for temperature in (0.0, 1.0):
        alone = [d.propose(d.new_cache(), 4, f, adapter, temperature, TorchRandom(torch.Generator().manual_seed(r)))
                 for r, f in enumerate(feats)]
        batch = []
        for r, f in enumerate(feats):  # the same random stream per row: run the batch once per row
            context = d.new_context_batch()
            context.add_rows(3)
            out = d.propose_batch(context, [4] * 3, feats, adapter, temperature, TorchRandom(torch.Generator().manual_seed(r)))
            batch.append(out[r] if temperature == 0 or r == 0 else None)
        for r, (a, b) in enumerate(zip(alone, batch)):
            if b is None:
                continue
            assert a.tokens.tolist() == b.tokens.tolist(), (selector, temperature, r)
            if a.q_probs is not None:
                assert torch.allclose(a.q_probs, b.q_probs, atol=1e-10)
            assert (a.confidence is None) == (b.confidence is None) == (selector != "dspark")
            if a.confidence is not None:
                assert torch.allclose(a.confidence, b.confidence, atol=1e-6)


# -- token trees in a batch ------------------------------------------------------------------------------
class RowTreeOracle:
    """Per row, `oracle_tree_drafter` over that row's greedy continuation (nested branches that fail
    at different depths; a different corruption period per row, so rows accept different lengths)."""

    def __init__(self, block_size: int, references: list[list[int]], seed: int) -> None:
        self.block_size, self.target_layer_ids = block_size, (0,)
        self.rows = [oracle_tree_drafter(block_size, ref, width=3, corrupt_every=3 + r, seed=seed + r)
                     for r, ref in enumerate(references)]
        self._admitted = 0

    def new_cache(self) -> dict:  # called once per row, in row order
        self._admitted += 1
        return {"row": self._admitted - 1, "inner": self.rows[self._admitted - 1].new_cache()}

    def propose(self, cache, *args) -> Draft:
        return self.rows[cache["row"]].propose(cache["inner"], *args)

    def propose_tree(self, cache, *args):
        return self.rows[cache["row"]].propose_tree(cache["inner"], *args)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=9), min_size=1, max_size=4),
       block_size=st.integers(1, 8), budget=st.integers(0, 16), tree_nodes=st.integers(1, 20),
       kind=st.sampled_from(["oracle_tree", "walk", "argmax"]), concurrency=st.none() | st.integers(1, 3),
       data=st.data())
def test_batched_tree_greedy_equals_each_row_alone(arch, prompts, block_size, budget, tree_nodes, kind, concurrency,
                                                   data):
    """verify="tree" in a batch: every row's tree sits at its own positions with its own ancestor mask,
    keeps the anchor and its accepted path (slots that need not be adjacent), and equals HF greedy."""
    target = tiny_target(arch)
    refs = [hf_greedy(target, p, max(budget, 1)) for p in prompts]
    stop = data.draw(st.none() | st.sampled_from(refs[0][len(prompts[0]):]), label="stop token")
    stops = [stop] if stop is not None else None
    expected = [hf_greedy(target, p, budget, stops) if budget > 0 else p for p in prompts]
    if kind == "oracle_tree":
        drafter = RowTreeOracle(block_size, refs, seed=budget)
    else:
        torch.manual_seed(block_size)
        drafter = DFlash2Drafter.from_target(target, block_size=block_size, selector=kind, selector_top_k=3,
                                             selector_rank=8, mask_token_id=VOCAB - 1, num_layers=1)
    results = spec_generate_batch(drafter, target, *left_pad(prompts), max_new_tokens=budget, stop_token_ids=stops,
                                  concurrency=concurrency, verify="tree", tree_nodes=tree_nodes)
    assert [r.sequences[0].tolist() for r in results] == expected
    for r in results:
        assert all(1 <= n <= block_size for n in r.acceptance_lengths)
        if budget > 0:
            assert r.new_tokens.numel() == 1 + sum(r.acceptance_lengths)


def test_batched_trees_accept_past_their_first_path():
    """The batch really verifies trees: with branches that break at different depths, each row
    commits more per round than its first path alone would (and the output is still HF greedy)."""
    target = tiny_target("qwen3")
    prompts = [[5, 9, 2, 7], [1], [3, 3, 3, 3, 3, 3, 8]]
    refs = [hf_greedy(target, p, 40) for p in prompts]
    tree = spec_generate_batch(RowTreeOracle(8, refs, seed=0), target, *left_pad(prompts), max_new_tokens=40,
                               verify="tree", tree_nodes=64)
    path = spec_generate_batch(RowTreeOracle(8, refs, seed=0), target, *left_pad(prompts), max_new_tokens=40)
    assert [r.sequences[0].tolist() for r in tree] == [r.sequences[0].tolist() for r in path] == refs
    for t, p in zip(tree, path):
        assert t.tau > p.tau, (t.tau, p.tau)


@pytest.mark.parametrize("selector", ["argmax", "walk", "dspark", "lilicorr"])
def test_propose_tree_batch_equals_propose_tree_per_row(selector):
    """The drafter's batched tree pass builds, per row, the tree that row builds alone, down to each
    row's own depth limit."""
    from dflash2.drafter.model import DFlash2Drafter

    target = tiny_target("llama")
    torch.manual_seed(5)
    d = DFlash2Drafter.from_target(target, block_size=6, selector=selector, selector_top_k=4 if selector == "lilicorr" else 3,
                                   selector_rank=8, mask_token_id=VOCAB - 1, num_layers=2)
    perturb_selector(d, 2.0)
    adapter = TargetAdapter(target, d.target_layer_ids)
    prompts = [[5, 9, 2, 7, 1, 1, 3, 4, 8, 2], [1], [3, 3, 8]]
    feats = [adapter.forward(torch.tensor([p]), adapter.new_cache()).features for p in prompts]
    depths = [5, 2, 0]
    alone = [d.propose_tree(d.new_cache(), 4, f, adapter, 7, depth) for f, depth in zip(feats, depths)]
    context = d.new_context_batch()
    context.add_rows(3)
    batch = d.propose_tree_batch(context, [4] * 3, feats, adapter, 7, depths)
    for a, b in zip(alone, batch):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert len(batch[0].tokens) == 7 and len(batch[2].tokens) == 0 and int(batch[1].depths().max()) <= 2
