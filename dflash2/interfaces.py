"""What a drafter and a selector may implement: the declared interfaces the loops check against.

    Drafter          propose one path per round                    spec_generate(verify="path")
    TreeDrafter      + propose_tree: a token tree per round        spec_generate(verify="tree")
    BatchDrafter     + new_context_batch, propose_batch,           spec_generate_batch: every row in one
                       propose_tree_batch                          drafter pass (else one cache per row)
    CheckedDrafter   + check_target: refuses a target it cannot read (every loop, before the first pass)
    Selector         the path through the B×K candidate lattice    DFlash2Drafter(config.selector)
    VerifyPolicy     how many drafted tokens of each row to verify  spec_generate(policy=...)

A new drafter implements `Drafter` (and the others where it can); nothing else is probed, with
isinstance against these runtime-checkable protocols. Also here: `Candidates` (top-K ids and scores),
`RoundContext` (what a selector may read beyond them), `Draft` (tokens, at T > 0 the candidates and
proposal q, and `confidence`: c_t = P(token t accepted | tokens < t accepted), which may read tokens
0..t-1, never token t; the verifier never reads it).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from dflash2.drafter.heads import Candidates, RoundContext
from dflash2.decoding.rng import RandomSource
from dflash2.decoding.sealed import SealedDrafts
from dflash2.decoding.tree import TokenTree
from dflash2.decoding.verify import Draft


@runtime_checkable
class VerifyPolicy(Protocol):
    """Sizes verification (path drafts and token trees). drafts: before a round, with `rows` rows in
    flight, whether to draft at all (False: a plain decoding step for every row; the drafter reads the
    skipped tokens' target features at its next round; neither widths nor observe is called for such a
    round). widths: the round's drafts sealed (`SealedDrafts`: lengths, and confidences revealed only as
    a stopping rule may read them) and its drafting seconds so far (None for a generation's first
    drafting round, which also reads the prompt's features) → how many of each row's tokens (a tree:
    nodes) to verify, from what it committed up to the row's length; the loop truncates a path to its
    first tokens, a tree to its first nodes. observe: after verification, the draft as drafted, the
    number verified and the indices of those accepted (a path: 0..a-1; a tree: the accepted nodes from
    the anchor down), for online calibration.

    Sealed because at T > 0 whether token t is verified must not depend on its value, which c_{t+1}
    may read: a policy sees no tokens, and c_t only once it has committed to tokens 0..t-1, so every
    width it returns is a stopping rule (dflash2.decoding.sealed; docs/architecture.md)."""

    def drafts(self, rows: int) -> bool: ...

    def widths(self, drafts: SealedDrafts, draft_s: float | None) -> list[int]: ...

    def observe(self, draft: Draft | TokenTree, verified: int, accepted: list[int]) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """What spec_generate needs: the block size, the target layers whose features it reads, a fresh
    per-sequence cache, and one path per round."""

    @property
    def block_size(self) -> int: ...

    @property
    def target_layer_ids(self) -> tuple[int, ...]: ...

    def new_cache(self) -> object: ...

    def propose(self, cache: object, anchor: int, new_features: Tensor | None, target, temperature: float,
                rng: RandomSource) -> Draft:
        """Extend `cache` by the target's features of the last committed positions (new_features
        [1, n, F], None for a drafter that reads no layers), then draft up to block_size - 1 tokens after
        `anchor`. At temperature > 0 the Draft carries the proposal distribution q it drew from."""
        ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    def propose_tree(self, cache: object, anchor: int, new_features: Tensor | None, target, max_nodes: int,
                     max_depth: int) -> TokenTree:
        """As `propose`, but a token tree of at most `max_nodes` nodes and depth `max_depth`
        (deterministic at every temperature: the tree verifier decides node by node)."""
        ...


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    def new_context_batch(self) -> object:
        """The shared context of a batch of rows (no rows yet); the batched loop adds and drops rows
        with its `add_rows(n)` and `select_rows(indices)` as rows join and leave."""
        ...

    def propose_batch(self, context: object, anchors: list[int], new_features: list[Tensor], target,
                      temperature: float, rng: RandomSource) -> list[Draft]:
        """Row r as `propose(row r's cache, anchors[r], new_features[r], ...)`, all rows in one pass."""
        ...

    def propose_tree_batch(self, context: object, anchors: list[int], new_features: list[Tensor], target,
                           max_nodes: int, max_depths: list[int]) -> list[TokenTree]:
        """Row r as `propose_tree(...)` with max_depths[r], all rows in one pass."""
        ...


@runtime_checkable
class CheckedDrafter(Drafter, Protocol):
    def check_target(self, target) -> None:
        """Raise ValueError naming what does not fit when this drafter cannot read `target` (a
        TargetAdapter): its hidden size, vocabulary or number of layers."""
        ...


@runtime_checkable
class Selector(Protocol):
    """A path selector over the candidate lattice: cands [L, K] (ids, unary scores U), hidden [L, H].

    Built by `factory(config)` from its registered name. Missing `select_batch` defaults to the rows one
    by one through `__call__` at T = 0, missing `trains_on_candidates` and `reads_context` to False; a missing `lattice` is
    refused when a token tree needs it (`dflash2.drafter.selectors.contract.complete_selector`)."""

    trains_on_candidates: bool  # True: the training loss scores its candidates with `edge_scores(prev, hidden, cand)`,
    #                             or, when the selector has no edge_scores, along the gold path of its `lattice`
    reads_context: bool  # True: __call__, select_batch and lattice take a keyword `context` (a RoundContext)

    def __call__(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                 rng: RandomSource) -> Draft: ...

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
        """The deterministic (T = 0) selection of R rows at once: cands [R, L, K], hidden [R, L, H]."""
        ...

    def lattice(self, cands: Candidates, hidden: Tensor, anchor) -> tuple[Tensor, Tensor]:
        """Scores of the lattice: first [..., K] from the anchor, steps [..., L-1, K, K] (unaries
        included); a path's score is first[k_0] + Σ_t steps[t-1, k_{t-1}, k_t]. Token trees are
        grown from these scores."""
        ...


__all__ = ["BatchDrafter", "Candidates", "CheckedDrafter", "Draft", "Drafter", "RoundContext", "SealedDrafts", "Selector",
           "TreeDrafter", "VerifyPolicy"]
