"""Tree verification: exact output distribution by enumeration for trees of width <= 3 and depth <= 3,
greedy = longest argmax path, and mutants (independent sampling per path; forgetting the residual)
that must fail. Pure: a toy language model given by a table, no HF model involved."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from dflash2 import SamplingParams
from dflash2.decoding.sampling import process_logits
from dflash2.decoding.tree import TokenTree, TreeVerdict, verify_tree
from dflash2.decoding.verify import verify_deterministic
from tests.helpers import enumerate_outcomes, max_abs_diff

V, N_NEW = 3, 4


@functools.lru_cache(maxsize=None)
def toy_logits(context: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.5


def draft_ranking(context: tuple[int, ...]) -> list[int]:
    """A drafter's preference order of next tokens (a different toy model)."""
    g = torch.Generator().manual_seed((hash(context) * 7 + 3) % (2**31))
    return torch.randperm(V, generator=g).tolist()


def build_tree(context: tuple[int, ...], widths: tuple[int, ...]) -> TokenTree:
    """widths[d]: children per node at depth d+1 (the drafter's top choices)."""
    paths = [[]]
    for w in widths:
        paths = [p + [t] for p in paths for t in draft_ranking(context + tuple(p))[:w]]
    return TokenTree.from_paths(paths)


def node_logits(context: tuple[int, ...], tree: TokenTree) -> torch.Tensor:
    rows = [toy_logits(context)]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    suffix: list[tuple[int, ...]] = []
    for i in range(len(tokens)):
        suffix.append((suffix[parents[i]] if parents[i] >= 0 else ()) + (tokens[i],))
        rows.append(toy_logits(context + suffix[i]))
    return torch.stack(rows)


def tree_program(params, widths, verifier=verify_tree, n_new=N_NEW):
    def program(rng):
        seq: tuple[int, ...] = (1,)
        while len(seq) - 1 < n_new:
            tree = build_tree(seq, widths)
            verdict = verifier(tree, node_logits(seq, tree), params, rng)
            new = [int(tree.tokens[n]) for n in verdict.path] + [verdict.next_token]
            seq += tuple(new[: n_new - (len(seq) - 1)])
        return seq[1:]
    return program


def ar_distribution(params, n_new=N_NEW) -> dict:
    out = {}
    for cont in itertools.product(range(V), repeat=n_new):
        prob, seq = 1.0, (1,)
        for t in cont:
            prob *= float(process_logits(toy_logits(seq), params)[t])
            seq += (t,)
        out[cont] = prob
    return out


TREES = {"chain_3": (1, 1, 1), "width_2": (2,), "width_3_depth_2": (3, 1), "2x2": (2, 2), "3x2x1": (3, 2, 1)}
PARAMS = {"T1": SamplingParams(1.0), "T0.7_topk2": SamplingParams(0.7, top_k=2), "T1.2_topp0.8": SamplingParams(1.2, top_p=0.8)}


@pytest.mark.parametrize("params_name", PARAMS)
@pytest.mark.parametrize("tree_name", TREES)
def test_tree_verification_is_exact(tree_name, params_name):
    params = PARAMS[params_name]
    got, branches = enumerate_outcomes(tree_program(params, TREES[tree_name]))
    print(f"{tree_name} {params_name}: {branches} branches")
    assert max_abs_diff(got, ar_distribution(params)) < 1e-12


def independent_paths(tree: TokenTree, logits, params, rng) -> TreeVerdict:
    """MUTANT: verify every root-to-leaf path on its own, keep the longest acceptance."""
    probs = process_logits(logits, params)
    leaves = [i for i in range(len(tree.tokens)) if not tree.children(i)]
    best = None
    for leaf in leaves:
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = int(tree.parents[node])
        path.reverse()
        rows = torch.stack([probs[0]] + [probs[n + 1] for n in path])
        v = verify_deterministic(tree.tokens[path], rows, rng)
        if best is None or v.num_accepted > len(best.path):
            best = TreeVerdict(path[: v.num_accepted], v.next_token)
    return best


def forgetful_residual(tree: TokenTree, logits, params, rng) -> TreeVerdict:
    """MUTANT: every child is tried against p̃ itself; the rejected children are never removed."""
    probs = process_logits(logits, params)
    path, node = [], -1
    while True:
        for child in tree.children(node):
            if rng.bernoulli(float(probs[node + 1, int(tree.tokens[child])])):
                path.append(child)
                node = child
                break
        else:
            return TreeVerdict(path, rng.categorical(probs[node + 1]))


@pytest.mark.parametrize("mutant", [independent_paths, forgetful_residual], ids=lambda f: f.__name__)
def test_tree_mutants_are_detected(mutant):
    # 2 new tokens: the independent-paths mutant draws afresh per leaf, so its branches explode
    params = PARAMS["T1"]
    got, _ = enumerate_outcomes(tree_program(params, TREES["2x2"], verifier=mutant, n_new=2))
    deviation = max_abs_diff(got, ar_distribution(params, n_new=2))
    print(f"{mutant.__name__}: max deviation {deviation:.3g}")
    assert deviation > 1e-4


def test_greedy_takes_the_longest_argmax_path():
    context = (2, 0)
    tree = build_tree(context, (3, 2, 1))
    logits = node_logits(context, tree)
    verdict = verify_tree(tree, logits, SamplingParams(0.0), rng=None)
    seq, expected = context, []
    while True:  # the target's own greedy continuation, followed while the tree has it
        x = int(toy_logits(seq).argmax())
        match = [i for i in range(len(tree.tokens)) if int(tree.tokens[i]) == x
                 and int(tree.parents[i]) == (expected[-1] if expected else -1)]
        if not match:
            assert verdict == TreeVerdict(expected, x)
            break
        expected.append(match[0])
        seq += (x,)


def test_tree_helpers():
    tree = TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9] and tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.children(-1) == [0, 4] and tree.children(0) == [1, 3]
    assert tree.depths().tolist() == [1, 2, 3, 2, 1]
    assert tree.ancestor_mask()[2].tolist() == [True, True, True, False, False]
    tree.validate()
    with pytest.raises(ValueError, match="repeat"):
        TokenTree(torch.tensor([5, 5]), torch.tensor([-1, -1])).validate()
