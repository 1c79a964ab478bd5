"""Lossless verification of a token tree (several lattice paths at once; docs/architecture.md, "Tree verification").

A `TokenTree` holds M draft nodes below the anchor. The target scores every node in one pass, giving
logits [M+1, V]: row 0 after the anchor, row i+1 after node i's path. The verifier walks down from
the anchor and takes **one decision per node, shared by all paths through it**:

* greedy: x = argmax at the node; move to the child whose token is x, or emit x;
* sampling: with r = p̃ at the node, try the children in order: accept child c with probability
  r(c); on rejection set r(c) = 0 and renormalise; if no child is accepted emit a draw from r.
  At a leaf (or when all children are rejected) the emitted token is the bonus / correction.

Each emitted token has exactly the distribution p̃ at its node, so the output distribution is the
target's (enumerated exactly in tests/test_tree.py). Sampling each path independently and keeping
the longest acceptance is lossy; so is forgetting the residual after a rejected child (mutants there).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch
from torch import Tensor

from .rng import RandomSource
from .sampling import SamplingParams, greedy_token, process_logits


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
        M = len(self.tokens)
        if self.parents.tolist() == list(range(-1, M - 1)):  # a chain (a path): depth = index, causal mask
            return torch.arange(M + 1), torch.ones(M + 1, M + 1, dtype=torch.bool).tril()
        depth = torch.cat([torch.zeros(1, dtype=torch.long), self.depths()])
        visible = torch.eye(M + 1, dtype=torch.bool)
        visible[:, 0] = True  # every node sees the anchor
        visible[1:, 1:] = self.ancestor_mask()
        return depth, visible

    def children(self, node: int) -> list[int]:
        """Node indices under `node` (-1 for the anchor), in try order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]

    def depths(self) -> Tensor:
        """[M]: 1 for children of the anchor, and so on (positions are anchor position + depth)."""
        parents, out = self.parents.tolist(), []
        for p in parents:
            out.append(1 if p < 0 else out[p] + 1)
        return torch.tensor(out, dtype=torch.long)

    def ancestor_mask(self) -> Tensor:
        """[M, M] bool: node i may attend to node j iff j is i or an ancestor of i (tree attention)."""
        M, parents = len(self.tokens), self.parents.tolist()
        mask = torch.eye(M, dtype=torch.bool)
        for i in range(M):
            p = parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask

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
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    if params.greedy:
        choice = greedy_token(logits).tolist()
        while True:
            x = choice[node + 1]
            nxt = next((c for c in tree.children(node) if tokens[c] == x), None)
            if nxt is None:
                return TreeVerdict(path, x)
            path.append(nxt)
            node = nxt
    probs = process_logits(logits, params)
    while True:
        residual = probs[node + 1].clone()
        accepted = None
        for child in tree.children(node):
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
    """
    L, K = ids.shape
    if L == 0 or max_nodes <= 0:
        return TokenTree.empty(ids.device)
    log_first = first.double().log_softmax(-1).tolist()
    log_steps = steps.double().log_softmax(-1)  # [L-1, K, K]
    cand = ids.tolist()
    heap = [(-log_first[k], 0, k, -1) for k in range(K)]  # (-value, depth, candidate, parent node)
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    while heap and len(tokens) < max_nodes:
        neg, t, k, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(cand[t][k])
        parents.append(parent)
        if t + 1 < L:
            for j, lp in enumerate(log_steps[t, k].tolist()):
                heapq.heappush(heap, (neg - lp, t + 1, j, node))
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=ids.device)  # noqa: E731
    return TokenTree(as_long(tokens), as_long(parents))
