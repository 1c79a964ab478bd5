"""Path selectors over the B×K candidate lattice (DFlash 2; docs/architecture.md, "Scores of the path selector").

Edge score from predecessor token a to candidate b at draft position t, starting from the anchor:

    S_t(a, b) = U_t(b) + ⟨A[a] ⊙ P(h_t), C[b]⟩      codebooks A, C in R^{V×r}; P: H → r

* `argmax`:  top-1 per position, no parameters (DFlash-1 behaviour);
* `walk`:    the published greedy walk: best successor of the current token (T=0), or a draw from
             softmax(S/T) over the K candidates (T>0), returning that q for verification;
* `viterbi`: the exact most probable path, Π_t softmax(S_t(a_{t-1}, ·))[a_t], in O(L·K²). It maximises
             the sum of per-step log-softmaxes, not of raw S, whose normaliser depends on a.

P is zero at init, so every selector starts as argmax and learns to deviate. Each is a
`dflash2.interfaces.Selector` (a path per sequence, a batched path, the lattice's scores for trees),
registered by name in `dflash2.registry`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


from dflash2.config import DFlash2Config
from dflash2.drafter.heads import Candidates
from dflash2.layers import as_rows
from dflash2.decoding.rng import RandomSource
from dflash2.registry import SELECTORS, register_selector
from dflash2.decoding.verify import Draft


class ArgmaxSelector(nn.Module):
    trains_on_candidates = False  # no parameters: nothing for the selector loss to train
    reads_context = False

    def __init__(self, config: DFlash2Config | None = None) -> None:
        super().__init__()

    def forward(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                rng: RandomSource) -> Draft:
        """cands [L, K] for one sequence → Draft of the top-1 tokens (deterministic)."""
        return Draft(cands.ids[:, 0])

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
        """cands [R, L, K] → one Draft per row (what forward gives row by row)."""
        return [Draft(row) for row in cands.ids[:, :, 0]]

    def lattice(self, cands: Candidates, hidden: Tensor, anchor) -> tuple[Tensor, Tensor]:
        """The unary scores alone (DFlash-1): first [..., K], steps [..., L-1, K, K] that do not depend
        on the predecessor."""
        K = cands.ids.shape[-1]
        return cands.scores[..., 0, :], cands.scores[..., 1:, None, :].expand(*cands.scores.shape[:-2], -1, K, K)


class PairwiseSelector(nn.Module):
    """A lattice of unary plus pairwise scores, S_t(a, b) = U_t(b) + edge_scores(a, h_t, b): the
    codebook selectors' and DSpark's Markov head's. Subclasses give `edge_scores`."""

    trains_on_candidates = True  # the training loss scores the top-K candidates with `edge_scores`
    reads_context = False

    def edge_scores(self, prev: Tensor, hidden: Tensor, cand: Tensor) -> Tensor:
        """Pairwise term: prev [..., P] ids, hidden [..., H], cand [..., K] ids → [..., P, K]."""
        raise NotImplementedError

    def lattice(self, cands: Candidates, hidden: Tensor, anchor) -> tuple[Tensor, Tensor]:
        """cands [..., L, K], hidden [..., L, H], anchor int (or ids [...]) → first [..., K] (from the
        anchor), steps [..., L-1, K, K].

        Score of the path (k_0..k_{L-1}) = first[k_0] + Σ_t steps[t-1, k_{t-1}, k_t]; unaries included.
        """
        U = cands.scores.to(torch.promote_types(hidden.dtype, torch.float32))
        anchor_ids = torch.as_tensor(anchor, device=cands.ids.device).reshape(*cands.ids.shape[:-2], 1)
        # (position 0 kept as a dimension: a graph frozen for inductor mishandles a product over a 1-D hidden)
        first = U[..., 0, :] + self.edge_scores(anchor_ids[..., None, :], hidden[..., :1, :], cands.ids[..., :1, :])[..., 0, 0, :]
        steps = U[..., 1:, None, :] + self.edge_scores(cands.ids[..., :-1, :], hidden[..., 1:, :], cands.ids[..., 1:, :])
        return first, steps


class CodebookSelector(PairwiseSelector):
    """Parameters and lattice scores shared by the walk and Viterbi selectors."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        V, r = config.vocab_size, config.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.randn(V, r) * 0.02)  # A
        self.successor_codebook = nn.Parameter(torch.randn(V, r) * 0.02)  # C
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)  # P
        nn.init.zeros_(self.hidden_projection.weight)

    def edge_scores(self, prev: Tensor, hidden: Tensor, cand: Tensor) -> Tensor:
        """Pairwise term: prev [..., P] ids, hidden [..., H], cand [..., K] ids → [..., P, K]."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # tiny products: half precision only loses
        projected = self.hidden_projection(as_rows(hidden)).view(*hidden.shape[:-1], self.hidden_projection.out_features)
        a = self.predecessor_codebook[prev].to(dtype) * projected.to(dtype).unsqueeze(-2)  # [..., P, r]
        return a @ self.successor_codebook[cand].to(dtype).transpose(-1, -2)  # [..., P, K]


def walk(first: Tensor, steps: Tensor, cand_ids: Tensor, temperature: float, rng: RandomSource) -> tuple[Draft, Tensor]:
    """The published walk over one lattice: first [K], steps [L-1, K, K], cand_ids [L, K] → (Draft,
    the picked candidate indices [L]). T = 0: the best successor of the current candidate; T > 0: a
    draw from softmax(scores / T) over the K successors, and that q in the Draft."""
    L = cand_ids.shape[0]
    scores, picks, qs = first, [], []
    for t in range(L):
        if t > 0:
            scores = steps[t - 1, picks[-1]]
        if temperature > 0:
            q = torch.softmax(scores.double() / temperature, dim=-1)
            picks.append(rng.categorical(q))
            qs.append(q)
        else:
            picks.append(int(scores.argmax()))
    index = torch.tensor(picks, dtype=torch.long, device=cand_ids.device)
    tokens = cand_ids.gather(1, index[:, None])[:, 0]
    if temperature > 0:
        return Draft(tokens, cand_ids, torch.stack(qs)), index
    return Draft(tokens), index


def walk_batch(first: Tensor, steps: Tensor, cand_ids: Tensor) -> Tensor:
    """The greedy (T = 0) walk of R lattices at once: first [R, K], steps [R, L-1, K, K], cand_ids
    [R, L, K] → the picked candidate indices [R, L]."""
    R, L, _ = cand_ids.shape
    pick = first.argmax(-1)  # [R]
    picks = [pick]
    rows = torch.arange(R, device=pick.device)
    for t in range(L - 1):
        pick = steps[rows, t, pick].argmax(-1)
        picks.append(pick)
    return torch.stack(picks, dim=1)  # [R, L]


class WalkSelector(CodebookSelector):
    def forward(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                rng: RandomSource) -> Draft:
        first, steps = self.lattice(cands, hidden, anchor)
        return walk(first, steps, cands.ids, temperature, rng)[0]

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
        """The greedy (T=0) walk of R rows at once: cands [R, L, K], hidden [R, L, H]."""
        first, steps = self.lattice(cands, hidden, anchors)  # [R, K], [R, L-1, K, K]
        index = walk_batch(first, steps, cands.ids)  # [R, L]
        return [Draft(row) for row in cands.ids.gather(2, index[..., None])[..., 0]]


class ViterbiSelector(CodebookSelector):
    def forward(self, cands: Candidates, hidden: Tensor, anchor: int, temperature: float,
                rng: RandomSource) -> Draft:
        first, steps = self.lattice(cands, hidden, anchor)  # [K], [L-1, K, K]
        path = viterbi_path(first.log_softmax(-1), steps.log_softmax(-1))  # per-step normalised
        return Draft(cands.ids.gather(1, path[:, None])[:, 0])

    def select_batch(self, cands: Candidates, hidden: Tensor, anchors: list[int]) -> list[Draft]:
        """Row by row (the path is exact and deterministic at any temperature)."""
        return [self(Candidates(cands.ids[r], cands.scores[r]), hidden[r], anchors[r], 0.0, None)
                for r in range(len(anchors))]


def viterbi_path(first: Tensor, steps: Tensor) -> Tensor:
    """Exact argmax path: first [K], steps [L-1, K, K] → indices [L] (ties: lowest index)."""
    best, back = first, []
    for step in steps:
        total = best[:, None] + step  # [K prev, K next]
        best, arg = total.max(dim=0)
        back.append(arg)
    path = [int(best.argmax())]
    for arg in reversed(back):
        path.append(int(arg[path[-1]]))
    return torch.tensor(path[::-1], dtype=torch.long, device=first.device)


for _name, _kind in (("argmax", ArgmaxSelector), ("walk", WalkSelector), ("viterbi", ViterbiSelector)):
    register_selector(_name, _kind)  # dspark and lilicorr register themselves in their own modules
BUILTIN = ("walk", "viterbi", "argmax")  # the selectors the published checkpoint format has


def build_selector(config: DFlash2Config):
    """The selector `config.selector` names (built in, registered, or "module:Name"), checked."""
    return SELECTORS.build(config.selector, config)
