"""verify="tree" end to end: the target's tree pass, the lattice tree, and the loop.

* the tree pass gives every node the logits of its own path run sequentially (float64, every
  architecture, sliding windows included), and keeping a path leaves the cache a fresh prefill has;
* greedy output equals HF generate for Hypothesis-drawn prompts, trees and budgets, with trees that
  accept past the point where their first path fails;
* sampled output has exactly the AR distribution, enumerated over every random branch of the real
  `spec_generate` (trees of width <= 3 and depth <= 3), and two mutants of the tree rule must fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dflash2.decoding.round as round_mod
from dflash2 import DFlash2Drafter, SamplingParams, TargetAdapter, spec_generate
from dflash2.decoding.sampling import process_logits
from dflash2.decoding.tree import TokenTree, TreeVerdict, best_first_tree, verify_tree
from dflash2.decoding.verify import verify_deterministic
from tests.helpers import (ARCHITECTURES, MORE_ARCHITECTURES, VOCAB, TreeStubDrafter, enumerate_outcomes, perturb_selector,
                           exact_ar_distribution, hf_greedy, max_abs_diff, needs_hybrid_transformers,
                           oracle_tree_drafter, tiny_target)

TREE_ARCHITECTURES = list(ARCHITECTURES) + list(MORE_ARCHITECTURES)


def node_paths(tree: TokenTree) -> list[list[int]]:
    tokens, parents, out = tree.tokens.tolist(), tree.parents.tolist(), []
    for i in range(len(tokens)):
        out.append((out[parents[i]] if parents[i] >= 0 else []) + [tokens[i]])
    return out


def random_tree(g: torch.Generator, nodes: int, vocab: int) -> TokenTree:
    paths = [torch.randint(0, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
             for _ in range(nodes)]
    paths += [paths[0][:2] + [t] for t in range(3)]  # siblings below a shared prefix
    return TokenTree.from_paths(paths)


# -- the target's tree pass ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TREE_ARCHITECTURES)
def test_tree_pass_equals_sequential_logits_and_keeps_the_path(arch):
    target = tiny_target(arch)
    adapter = TargetAdapter(target, (0, 2))
    g = torch.Generator().manual_seed(len(arch))
    prompt = torch.randint(0, VOCAB - 1, (1, 9), generator=g)  # 9 + depth 6 > the sliding windows (5, 6)
    cache = adapter.new_cache()
    adapter.forward(prompt, cache)
    tree = random_tree(g, 5, VOCAB - 1)
    step = adapter.forward_tree(7, tree, cache)
    paths = node_paths(tree)
    worst = 0.0
    for row, path in enumerate([[], *paths]):
        seq = torch.cat([prompt, torch.tensor([[7, *path]])], dim=1)
        with torch.no_grad():
            out = target(seq, output_hidden_states=True)
        worst = max(worst, float((out.logits[0, -1] - step.logits[0, row]).abs().max()))
        feats = torch.cat([out.hidden_states[1][0, -1], out.hidden_states[3][0, -1]])
        worst = max(worst, float((feats - step.features[0, row]).abs().max()))
    assert worst < 1e-10, worst

    deepest = max(range(len(paths)), key=lambda i: len(paths[i]))
    chain, node = [], deepest
    while node >= 0:
        chain.append(node)
        node = int(tree.parents[node])
    chain.reverse()
    adapter.keep(cache, step, [0, *(n + 1 for n in chain)])
    fresh = adapter.new_cache()
    adapter.forward(torch.cat([prompt, torch.tensor([[7, *paths[deepest]]])], dim=1), fresh)
    assert cache.get_seq_length() == fresh.get_seq_length()
    for ours, theirs in zip(cache.layers, fresh.layers):
        assert torch.allclose(ours.keys, theirs.keys, atol=1e-12) and torch.allclose(ours.values, theirs.values, atol=1e-12)


def test_tree_mask_matters():
    """The equality above is not vacuous: letting siblings see each other changes the logits."""
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target)
    tree = TokenTree.from_paths([[3, 4], [5, 6]])
    cache = adapter.new_cache()
    adapter.forward(torch.tensor([[1, 2, 3]]), cache)
    tree_logits = adapter.forward_tree(9, tree, cache).logits[0, 3]  # after [9, 5]
    chain = target(torch.tensor([[1, 2, 3, 9, 3, 4, 5]])).logits[0, -1]  # [9, 3, 4, 5] sequentially
    assert (tree_logits - chain).abs().max() > 1e-3


def test_masked_passes_use_grouped_heads_and_restore_the_attention_setting(monkeypatch):
    """Tree and batch passes run PyTorch's SDPA on the grouped K/V heads with the mask (no per-head
    copy of the cache: dflash2/targets/attention.py), and leave the target's setting as it was, even
    when the pass fails. The logits are the sequential ones (the test above covers every architecture)."""
    target = tiny_target("qwen3")  # 4 query heads, 2 K/V heads
    assert target.config._attn_implementation == "sdpa"
    adapter = TargetAdapter(target)
    cache = adapter.new_cache()
    adapter.forward(torch.tensor([[1, 2, 3]]), cache)
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False), kw.get("attn_mask") is not None))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    adapter.forward_tree(9, TokenTree.from_paths([[3, 4], [5, 6]]), cache)
    assert calls == [(4, 2, True, True)] * target.config.num_hidden_layers
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(IndexError):  # a token outside the vocabulary fails inside the pass
        adapter.forward_tree(9, TokenTree.from_paths([[10 ** 6]]), cache)
    assert target.config._attn_implementation == "sdpa"


# -- the lattice tree ----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 5), K=st.integers(1, 4), max_nodes=st.integers(1, 30), seed=st.integers(0, 10**6))
def test_best_first_tree_holds_the_most_probable_nodes(L, K, max_nodes, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(L)])
    first, steps = torch.randn(K, generator=g, dtype=torch.float64), torch.randn(L - 1, K, K, generator=g, dtype=torch.float64)
    tree = best_first_tree(ids, first, steps, max_nodes)
    tree.validate()
    # brute force: value of every lattice node (a path of candidate indices)
    values = {}
    frontier = [((k,), float(first.log_softmax(-1)[k])) for k in range(K)]
    while frontier:
        path, v = frontier.pop()
        values[path] = v
        if len(path) < L:
            frontier += [(path + (j,), v + float(steps[len(path) - 1, path[-1]].log_softmax(-1)[j])) for j in range(K)]
    assert len(tree.tokens) == min(max_nodes, len(values))
    ranked = sorted(values.values(), reverse=True)
    chosen = sorted((values[p] for p in values if [int(ids[t, k]) for t, k in enumerate(p)] in node_paths(tree)), reverse=True)
    assert chosen == pytest.approx(ranked[: len(chosen)])
    # the first branch (first child at every node) is the greedy walk through the lattice
    k, walk = int(first.argmax()), []
    for t in range(L):
        walk.append(int(ids[t, k]))
        if t + 1 < L:
            k = int(steps[t, k].argmax())
    branch, node = [], -1
    while tree.children(node):
        node = tree.children(node)[0]
        branch.append(int(tree.tokens[node]))
    assert branch == walk[: len(branch)]


def full_heap_tree(ids, first, steps, max_nodes) -> TokenTree:
    """best_first_tree's order by the plain algorithm: every successor of a taken node pushed at once."""
    import heapq

    L, K = ids.shape
    log_first, log_steps = first.double().log_softmax(-1).tolist(), steps.double().log_softmax(-1)
    heap = [(-log_first[k], 0, k, -1) for k in range(K)]
    heapq.heapify(heap)
    tokens, parents = [], []
    while heap and len(tokens) < max_nodes:
        neg, t, k, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ids[t, k]))
        parents.append(parent)
        if t + 1 < L:
            for j, lp in enumerate(log_steps[t, k].tolist()):
                heapq.heappush(heap, (neg - lp, t + 1, j, node))
    return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 5), K=st.integers(1, 6), max_nodes=st.integers(1, 40), seed=st.integers(0, 10**6),
       ties=st.booleans())
def test_best_first_tree_takes_the_nodes_in_the_full_heaps_order(L, K, max_nodes, seed, ties):
    """Pushing a node's successors one at a time (best_first_tree) takes the same nodes in the same order
    as pushing them all: ties included (small integer scores repeat, so values tie across siblings,
    cousins and depths, and the heap's candidate and parent order decides)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(L)])
    if ties:
        first = torch.randint(0, 3, (K,), generator=g).double()
        steps = torch.randint(0, 3, (max(L - 1, 0), K, K), generator=g).double()
    else:
        first, steps = torch.randn(K, generator=g, dtype=torch.float64), torch.randn(L - 1, K, K, generator=g,
                                                                                     dtype=torch.float64)
    ours, plain = best_first_tree(ids, first, steps, max_nodes), full_heap_tree(ids, first, steps, max_nodes)
    assert ours.tokens.tolist() == plain.tokens.tolist() and ours.parents.tolist() == plain.parents.tolist()


# -- greedy equality through the loop -------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def dflash_drafter(arch: str, block_size: int, selector: str) -> DFlash2Drafter:
    torch.manual_seed(block_size)
    return DFlash2Drafter.from_target(tiny_target(arch), block_size=block_size, selector=selector, selector_top_k=3,
                                      selector_rank=8, mask_token_id=VOCAB - 1, num_layers=1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
       block_size=st.integers(1, 9), budget=st.integers(0, 20), tree_nodes=st.integers(1, 24),
       kind=st.sampled_from(["oracle_tree", "walk", "argmax", "viterbi"]))
def test_tree_greedy_equals_hf_generate(arch, data, prompt, block_size, budget, tree_nodes, kind):
    target = tiny_target(arch)
    reference = hf_greedy(target, prompt, max(budget, 1))
    stop = data.draw(st.none() | st.sampled_from(reference[len(prompt):]), label="stop token")
    stops = [stop] if stop is not None else None
    expected = hf_greedy(target, prompt, budget, stops) if budget > 0 else prompt
    drafter = (oracle_tree_drafter(block_size, reference, width=3, corrupt_every=3, seed=budget)
               if kind == "oracle_tree" else dflash_drafter(arch, block_size, kind))
    result = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=budget, stop_token_ids=stops,
                           verify="tree", tree_nodes=tree_nodes)
    assert result.sequences[0].tolist() == expected
    assert all(1 <= n <= block_size for n in result.acceptance_lengths)
    if budget > 0:
        assert result.new_tokens.numel() == 1 + sum(result.acceptance_lengths)


def test_tree_accepts_past_its_first_path():
    """With branches that break at different depths, the tree beats its own first path."""
    target, prompt, block = tiny_target("qwen3"), [4, 4, 8], 8
    reference = hf_greedy(target, prompt, 40)
    drafter = oracle_tree_drafter(block, reference, width=3, corrupt_every=3, seed=0)
    tree = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=40, verify="tree", tree_nodes=64)
    path = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=40)
    assert tree.sequences[0].tolist() == path.sequences[0].tolist() == reference
    print(f"tau tree {tree.tau:.2f} vs path {path.tau:.2f}")
    assert tree.tau > path.tau + 1


# -- exact distribution by enumeration ----------------------------------------------------------------
V, PROMPT, N_NEW = 3, [1, 2], 4


@functools.lru_cache(maxsize=None)
def small_target():
    return tiny_target("qwen3", vocab=V, seed=3)


def ranking(anchor: int, pos: int, prefix: tuple[int, ...]) -> list[int]:
    g = torch.Generator().manual_seed(hash((anchor, pos, prefix)) % (2**31))
    return torch.randperm(V, generator=g).tolist()


def stub_tree(widths: tuple[int, ...]) -> TreeStubDrafter:
    """widths[d]: children per node at depth d+1, the stub's preferred tokens there."""
    def fn(anchor, pos):
        paths = [[]]
        for w in widths:
            paths = [p + [t] for p in paths for t in ranking(anchor, pos, tuple(p))[:w]]
        return paths
    return TreeStubDrafter(len(widths) + 1, fn)


def lattice_drafter(selector: str = "walk") -> DFlash2Drafter:
    torch.manual_seed(11)
    d = DFlash2Drafter.from_target(small_target(), block_size=3, selector=selector, selector_top_k=2, selector_rank=4,
                                   mask_token_id=V - 1, lilicorr_num_layers=1, lilicorr_factor_dim=8)
    return perturb_selector(d, 3.0)


DRAFTERS = {"chain_3": lambda: stub_tree((1, 1, 1)), "width_3": lambda: stub_tree((3,)),
            "2x2": lambda: stub_tree((2, 2)), "3x2x1": lambda: stub_tree((3, 2, 1)), "lattice_k2": lattice_drafter,
            "lattice_k2_dspark": lambda: lattice_drafter("dspark"), "lattice_k2_lilicorr": lambda: lattice_drafter("lilicorr")}
PARAMS = {"T1": SamplingParams(1.0), "T0.7_topk2": SamplingParams(0.7, top_k=2), "T1.3_topp0.8": SamplingParams(1.3, top_p=0.8)}


def tree_distribution(drafter, params: SamplingParams, lengths: set | None = None, n_new: int = N_NEW, policy=None):
    """policy: a factory of the verification policy each branch runs with (tests/policy/test_policy.py)."""
    def program(rng):
        out = spec_generate(drafter, small_target(), torch.tensor([PROMPT]), max_new_tokens=n_new,
                            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, rng=rng,
                            verify="tree", tree_nodes=8, policy=policy() if policy else None)
        if lengths is not None:
            lengths.update(out.acceptance_lengths)
        return tuple(out.new_tokens.tolist())
    return enumerate_outcomes(program)


def ar_distribution(params: SamplingParams, n_new: int = N_NEW):
    return exact_ar_distribution(small_target(), PROMPT, n_new, lambda logits: process_logits(logits, params))


@pytest.mark.parametrize("params_name", PARAMS)
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_tree_sampling_is_exact(drafter_name, params_name):
    params, lengths = PARAMS[params_name], set()
    got, branches = tree_distribution(DRAFTERS[drafter_name](), params, lengths)
    print(f"{drafter_name} {params_name}: {branches} branches, acceptance lengths {sorted(lengths)}")
    assert max(lengths) > 1, "no multi-token acceptance: the test would compare AR with AR"
    assert max_abs_diff(got, ar_distribution(params)) < 1e-12


def paths_to_leaves(tree: TokenTree) -> list[list[int]]:
    leaves = [i for i in range(len(tree.tokens)) if not tree.children(i)]
    out = []
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = int(tree.parents[node])
        out.append(path[::-1])
    return out


def verify_each_path(tree, logits, params, rng):
    """Yields a verdict per root-to-leaf path, each verified on its own with fresh draws (lossy)."""
    probs = process_logits(logits, params)
    for path in paths_to_leaves(tree):
        v = verify_deterministic(tree.tokens[path], torch.stack([probs[0]] + [probs[n + 1] for n in path]), rng)
        yield TreeVerdict(path[: v.num_accepted], v.next_token)


def longest_accepted_path(tree, logits, params, rng) -> TreeVerdict:
    """MUTANT: verify each root-to-leaf path on its own (fresh draws) and keep the longest acceptance."""
    if params.greedy or len(tree.tokens) == 0:
        return verify_tree(tree, logits, params, rng)
    return max(verify_each_path(tree, logits, params, rng), key=lambda v: len(v.path))


def first_accepting_path(tree, logits, params, rng) -> TreeVerdict:
    """MUTANT: independent sampling per path: try the paths in order, take the first that accepts."""
    if params.greedy or len(tree.tokens) == 0:
        return verify_tree(tree, logits, params, rng)
    last = None
    for last in verify_each_path(tree, logits, params, rng):  # lazily: stop drawing at the first acceptance
        if last.path:
            break
    return last


@pytest.mark.parametrize("mutant", [longest_accepted_path, first_accepting_path], ids=lambda f: f.__name__)
def test_tree_mutants_in_the_loop_are_detected(mutant, monkeypatch):
    monkeypatch.setattr(round_mod, "verify_tree", mutant)  # the round both loops share
    params = PARAMS["T1"]
    got, _ = tree_distribution(stub_tree((2, 1)), params, n_new=3)
    deviation = max_abs_diff(got, ar_distribution(params, n_new=3))
    print(f"{mutant.__name__}: max deviation {deviation:.3g}")
    assert deviation > 1e-4


# -- errors -----------------------------------------------------------------------------------------
def test_tree_errors():
    from tests.helpers import StubDrafter

    target = tiny_target("qwen3")
    d = dflash_drafter("qwen3", 4, "walk")
    with pytest.raises(ValueError, match="verify must be"):
        spec_generate(d, target, torch.tensor([[1]]), max_new_tokens=2, verify="trees")
    with pytest.raises(ValueError, match="tree_nodes"):
        spec_generate(d, target, torch.tensor([[1]]), max_new_tokens=2, verify="tree", tree_nodes=0)
    with pytest.raises(ValueError, match="propose_tree"):
        spec_generate(StubDrafter(4, lambda a, p: [1, 2, 3]), target, torch.tensor([[1]]), max_new_tokens=2,
                      verify="tree")


@needs_hybrid_transformers
def test_tree_refused_on_hybrid_targets():
    from tests.helpers import HYBRID_ARCHITECTURES

    arch = next(iter(HYBRID_ARCHITECTURES))
    target = tiny_target(arch)
    d = oracle_tree_drafter(4, [0] * 40, width=2, corrupt_every=0, seed=0)
    with pytest.raises(ValueError, match="attention-only"):
        spec_generate(d, target, torch.tensor([[1, 2]]), max_new_tokens=4, verify="tree")
