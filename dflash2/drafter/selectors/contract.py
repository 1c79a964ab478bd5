"""What a selector must have: `complete_selector` checks one when the registry builds it, and fills in
the two members with a sound default (dflash2.interfaces.Selector)."""

from __future__ import annotations

from functools import partial
from types import MethodType

from torch import Tensor

from dflash2.decoding.verify import Draft
from dflash2.drafter.heads import Candidates


def complete_selector(selector, name: str):
    """`selector` with every member of `dflash2.interfaces.Selector`, or a TypeError that says which one
    is missing and what it is for. Two have a sound default, filled in on the object: `select_batch`
    (the rows one by one through `__call__` at T = 0) and `trains_on_candidates` (False: no selector
    term in the training loss). A missing `lattice` is said when a token tree asks for it."""
    what = f"selector {name!r} ({type(selector).__module__}.{type(selector).__qualname__})"
    if not callable(selector):
        raise TypeError(f"{what} is not callable: a selector's __call__(cands, hidden, anchor, temperature, rng) -> "
                        "Draft gives the path of one sequence at any temperature (dflash2.interfaces.Selector; cands "
                        "is a dflash2.interfaces.Candidates: ids and scores [L, K])")
    for member in ("trains_on_candidates", "reads_context"):
        if not hasattr(selector, member):
            setattr(selector, member, False)
    if selector.trains_on_candidates and not any(callable(getattr(selector, m, None)) for m in ("edge_scores", "lattice")):
        raise TypeError(f"{what} has trains_on_candidates = True but no edge_scores(prev [..., P], hidden [..., H], "
                        "cand [..., K]) -> [..., P, K]: the pairwise scores the training loss adds to the unary ones "
                        "(or a lattice, which the loss then follows along the gold path); add one, or set "
                        "trains_on_candidates = False")
    if not callable(getattr(selector, "select_batch", None)):
        selector.select_batch = MethodType(_rowwise_select_batch, selector)
    if not callable(getattr(selector, "lattice", None)):
        selector.lattice = MethodType(partial(_no_lattice, what=what), selector)
    return selector


def _rowwise_select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
    """The default select_batch: each of the R rows through the selector's own __call__ at T = 0."""
    return [self(Candidates(cands.ids[r], cands.scores[r]), hidden[r], anchors[r], 0.0, None)
            for r in range(len(anchors))]


def _no_lattice(self, cands: Candidates, hidden: Tensor, anchor, *, what: str):
    raise TypeError(f"{what} has no lattice(cands, hidden, anchor) -> (first [..., K], steps [..., L-1, K, K]): the "
                    "scores of the B×K lattice that token trees are grown from, so verify='tree' cannot use it "
                    "(verify='path' needs no lattice); add it (dflash2.interfaces.Selector)")
