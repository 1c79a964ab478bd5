"""Lossless verification of a token tree (several lattice paths at once; docs/architecture.md, "Tree verification").

A `TokenTree` holds M draft nodes below the anchor. The target scores every node in one pass, giving
logits [M+1, V]: row 0 after the anchor, row i+1 after node i's path. The verifier walks down from
the anchor and takes **one decision per node, shared by all paths through it**:

* greedy: x = argmax at the node; move to the child whose token is x, or emit x;
* sampling: with r = p̃ at the node, try the children in order: accept child c with probability
  r(c); on rejection set r(c) = 0 and renormalise; if no child is accepted emit a draw from r.
  At a leaf (or when all children are rejected) the emitted token is the bonus / correction.

Each emitted token has exactly the distribution p̃ at its node, so the output distribution is the
target's (enumerated exactly in tests/decoding/test_tree.py). Sampling each path independently and keeping
the longest acceptance is lossy; so is forgetting the residual after a rejected child (mutants there).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dflash2.decoding.rng import RandomSource
from dflash2.decoding.sampling import SamplingParams, greedy_token, process_logits


class TokenTree(NamedTuple):
    """tokens [M] long; parents [M] long (-1: a child of the anchor; otherwise an earlier index).
    Siblings must carry distinct tokens; they are tried in index order."""

    tokens: Tensor
    parents: Tensor

    @staticmethod
    def empty(device=None) -> "TokenTree":
        none = torch.zeros(0, dtype=torch.long, device=device)
        return TokenTree(none, none.clone())

    @staticmethod
    def from_paths(paths: list[list[int]]) -> "TokenTree":
        """Merge paths (token lists after the anchor) by common prefix, in order of first appearance."""
        index: dict[tuple[int, ...], int] = {}
        tokens, parents = [], []
        for path in paths:
            for depth in range(len(path)):
                key = tuple(path[: depth + 1])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(path[depth])
                    parents.append(index[key[:-1]] if depth else -1)
        return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    @staticmethod
    def chain(tokens: Tensor) -> "TokenTree":
        """A path [M] as a tree: each token the only child of the one before."""
        return TokenTree(tokens, torch.arange(-1, tokens.shape[0] - 1, device=tokens.device))

    def truncate(self, nodes: int) -> "TokenTree":
        """The first `nodes` nodes: a tree still (parents point to earlier nodes), and of a best-first
        tree the `nodes` most probable ones. Each kept node is verified as in the whole tree: its
        acceptance depends on its ancestors and earlier siblings, all earlier in index order."""
        nodes = max(nodes, 0)
        if nodes >= self.tokens.shape[0]:
            return self
        return TokenTree(self.tokens[:nodes], self.parents[:nodes])

    def block(self) -> tuple[Tensor, Tensor]:
        """The pass over [anchor, nodes]: depth [M+1] (0 for the anchor; positions are the anchor's
        plus depth) and visible [M+1, M+1] bool (row i sees the anchor, itself and its ancestors)."""
        M, parents = len(self.tokens), self.parents.tolist()
        if parents == list(range(-1, M - 1)):  # a chain (a path): depth = index, causal mask
            return torch.arange(M + 1), torch.ones(M + 1, M + 1, dtype=torch.bool).tril()
        depth, rows = [0], [[True] + [False] * M]  # the anchor sees itself (and the cache)
        for i, p in enumerate(parents):  # (Python lists: a tensor operation per node costs more than the tree)
            depth.append(depth[p + 1] + 1)
            row = rows[p + 1].copy()  # what its parent sees (the anchor, its ancestors), and itself
            row[i + 1] = True
            rows.append(row)
        return torch.tensor(depth), torch.tensor(rows)

    def children(self, node: int) -> list[int]:
        """Node indices under `node` (-1 for the anchor), in try order."""
        return self.children_lists().get(node, [])

    def children_lists(self) -> dict[int, list[int]]:
        """children() of every node that has some (-1: the anchor), read once."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents.tolist()):
            out.setdefault(p, []).append(i)
        return out

    def depths(self) -> Tensor:
        """[M]: 1 for children of the anchor, and so on (positions are anchor position + depth)."""
        parents, out = self.parents.tolist(), []
        for p in parents:
            out.append(1 if p < 0 else out[p] + 1)
        return torch.tensor(out, dtype=torch.long)

    def ancestor_mask(self) -> Tensor:
        """[M, M] bool: node i may attend to node j iff j is i or an ancestor of i (tree attention)."""
        return self.block()[1][1:, 1:]

    def validate(self) -> None:
        parents = self.parents.tolist()
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError("tree parents must point to earlier nodes (or -1 for the anchor)")
        tokens = self.tokens.tolist()
        for node in [-1, *range(len(tokens))]:
            kids = [tokens[c] for c in self.children(node)]
            if len(kids) != len(set(kids)):
                raise ValueError(f"siblings under node {node} repeat a token: {kids}")


class TreeVerdict(NamedTuple):
    """path: accepted node indices from the anchor down; next_token: the correction or bonus."""

    path: list[int]
    next_token: int


def verify_tree(tree: TokenTree, logits: Tensor, params: SamplingParams, rng: RandomSource) -> TreeVerdict:
    """logits [M+1, V]: row 0 after the anchor, row i+1 after node i."""
    if logits.shape[0] != len(tree.tokens) + 1:
        raise ValueError(f"expected logits for {len(tree.tokens) + 1} rows, got {logits.shape[0]}")
    tokens, kids = tree.tokens.tolist(), tree.children_lists()
    path: list[int] = []
    node = -1
    if params.greedy:
        choice = greedy_token(logits).tolist()
        while True:
            x = choice[node + 1]
            nxt = next((c for c in kids.get(node, ()) if tokens[c] == x), None)
            if nxt is None:
                return TreeVerdict(path, x)
            path.append(nxt)
            node = nxt
    probs = process_logits(logits, params)
    while True:
        residual = probs[node + 1].clone()
        accepted = None
        for child in kids.get(node, ()):
            tok = tokens[child]
            if rng.bernoulli(min(1.0, float(residual[tok]))):
                accepted = child
                break
            residual[tok] = 0.0  # rejected only when r(c) < 1, so some mass remains
            residual = residual / residual.sum()
        if accepted is None:
            return TreeVerdict(path, rng.categorical(residual))
        path.append(accepted)
        node = accepted


def best_first_tree(ids: Tensor, first: Tensor, steps: Tensor, max_nodes: int) -> TokenTree:
    """The `max_nodes` most probable nodes of the candidate lattice, as a token tree.

    ids [L, K] candidate tokens per draft position; first [K] scores from the anchor; steps [L-1, K, K]
    scores from candidate i at position t to candidate j at t+1 (a selector's lattice, or the unary
    scores repeated). A node's value is the sum of log-softmax (over the K successors) of the scores
    along its path; values only fall with depth, so the best nodes form a prefix-closed set, grown
    best-first from the anchor. Siblings come out best first, which is the order they are tried.
    The selector's greedy path is the tree's first branch.

    A heap keyed (-value, depth, candidate, parent) holds about two entries per node: a node pushes its
    best child and its next sibling when it is taken, and every node not pushed yet ranks after one that
    is, so nodes leave as from a heap of all of them (siblings equal to rounding may swap).
    """
    L, K = ids.shape
    if L == 0 or max_nodes <= 0:
        return TokenTree.empty(ids.device)
    log_first = first.detach().double().log_softmax(-1).cpu()
    log_steps = steps.detach().double().log_softmax(-1).cpu()  # [L-1, K, K]
    # successors best first, ties in candidate order; numpy rows: a node's successors read in microseconds
    step_values = log_steps.numpy()
    step_order = np.argsort(-step_values, axis=-1, kind="stable")
    cand = ids.tolist()
    # per expanded node (the anchor last, at index -1): (successors best first, their log-probabilities, -value)
    rows = [(log_first.argsort(descending=True, stable=True).tolist(), log_first.tolist(), 0.0)]
    heap = [(-rows[0][1][rows[0][0][0]], 0, rows[0][0][0], -1, 0)]  # (-value, depth, candidate, parent, rank)
    expanded = {-1: 0}  # node → its entry in rows
    tokens: list[int] = []
    parents: list[int] = []
    while heap and len(tokens) < max_nodes:
        neg, t, k, parent, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(cand[t][k])
        parents.append(parent)
        order, values, base = rows[expanded[parent]]
        if rank + 1 < K:  # the next sibling
            j = order[rank + 1]
            heapq.heappush(heap, (base - values[j], t, j, parent, rank + 1))
        if t + 1 < L:  # the best child
            order, values = step_order[t, k].tolist(), step_values[t, k].tolist()
            expanded[node] = len(rows)
            rows.append((order, values, neg))
            heapq.heappush(heap, (neg - values[order[0]], t + 1, order[0], node, 0))
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=ids.device)  # noqa: E731
    return TokenTree(as_long(tokens), as_long(parents))
