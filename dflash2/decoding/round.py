"""One round of speculative decoding, per row: shared by spec_generate and spec_generate_batch.

    drafts  = propose_rows(...)       each row's path (a Draft cut to its budget) or token tree, from
                                      its own drafter cache or all rows in one BatchDrafter pass
    (the loop runs the target over [anchor, draft]: one sequence, or every row's block in one pass)
    outcome = decide(draft, logits)   verify the path or walk the tree → the tokens to commit, whether
                                      a stop token came, and which block rows every cache keeps
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash2.interfaces import Drafter
from dflash2.decoding.rng import RandomSource
from dflash2.decoding.sampling import SamplingParams, greedy_token, process_logits
from dflash2.decoding.tree import TokenTree, verify_tree
from dflash2.decoding.verify import Draft, Verdict, commit, verify_block


@dataclass(frozen=True)
class Outcome:
    committed: list[int]  # this round's tokens: the accepted drafts, then the target's own token
    drafted: int  # how many of them are accepted draft tokens
    stopped: bool  # a stop token was committed (the round ends with it)
    kept: list[int]  # block rows (0: the anchor) whose cache entries and features the next round keeps


class Backlog:
    """One row's target features the drafter has not read yet: [1, n_i, F] chunks added each round
    and joined once, when the drafter reads them (`take`), so that a stretch of rounds that do not
    draft does not copy its growing backlog every round. A chunk may be row `row` of a batch's
    features [R, n_i, F], cut out at `take` too: a plain step of R rows then adds R references, not R
    slices (a round that does not draft pays for nothing the drafter has not read)."""

    __slots__ = ("chunks",)

    def __init__(self, features: Tensor | None = None) -> None:
        self.chunks: list[tuple[Tensor, int | None]] = []
        self.add(features)

    def add(self, features: Tensor | None, row: int | None = None) -> None:
        """Add features [1, n, F], or with `row` row `row` of features [R, n, F]."""
        if features is not None:
            self.chunks.append((features, row))

    def take(self) -> Tensor | None:
        """Every chunk in order as one [1, n, F] (None when there is none); the backlog is empty after."""
        chunks, self.chunks = [f if r is None else f[r: r + 1] for f, r in self.chunks], []
        if len(chunks) <= 1:
            return chunks[0] if chunks else None
        return torch.cat(chunks, dim=1)


def first_token(logits: Tensor, params: SamplingParams, rng: RandomSource) -> int:
    """One token from logits [V] (the prefill's, or an AR step): the same p̃ as verification uses."""
    if params.greedy:
        return int(greedy_token(logits).item())
    return rng.categorical(process_logits(logits, params))


def propose_rows(drafter: Drafter, context, caches: list, anchors: list[int], features: list[Tensor | None],
                 target, params: SamplingParams, rng: RandomSource, verify: str, tree_nodes: int,
                 depths: list[int]) -> list[Draft | TokenTree]:
    """Each row's draft, at most depths[r] tokens deep. `context`: the rows' shared context of a
    BatchDrafter (one drafter pass for all rows), or None: row r drafts from caches[r] alone."""
    if context is None:
        if verify == "tree":
            return [drafter.propose_tree(c, a, f, target, tree_nodes, d)
                    for c, a, f, d in zip(caches, anchors, features, depths)]
        return [drafter.propose(c, a, f, target, params.temperature, rng).truncate(d)
                for c, a, f, d in zip(caches, anchors, features, depths)]
    if verify == "tree":
        return drafter.propose_tree_batch(context, anchors, features, target, tree_nodes, depths)
    drafts = drafter.propose_batch(context, anchors, features, target, params.temperature, rng)
    return [d.truncate(depth) for d, depth in zip(drafts, depths)]


def decide(draft: Draft | TokenTree, logits: Tensor, params: SamplingParams, rng: RandomSource, budget: int,
           stops: frozenset[int]) -> Outcome:
    """logits [1 + n, V]: the target's over [anchor, the draft's n tokens or nodes] → the round's Outcome."""
    if isinstance(draft, TokenTree):
        found = verify_tree(draft, logits, params, rng)
        tokens, verdict = draft.tokens[found.path].tolist(), Verdict(len(found.path), found.next_token)
        kept = [0, *(node + 1 for node in found.path)]  # the anchor and the accepted path
    else:
        verdict = verify_block(draft, logits, params, rng)
        tokens, kept = draft.tokens.tolist(), list(range(verdict.num_accepted + 1))
    committed, stopped = commit(tokens, verdict, budget, stops)
    return Outcome(committed, min(verdict.num_accepted, len(committed)), stopped, kept)


def synchronizer(device: torch.device):
    """Timing on CUDA needs a sync at each boundary; on CPU it is a no-op."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
