"""Confidence: how likely each drafted token is to survive verification, and what follows from it.

    c_t = P(token t accepted | tokens 1..t-1 accepted)            [L]   (Draft.confidence)
    s_t = Π_{u<=t} c_u = P(the first t tokens all accepted)        survival [L]
    E[accepted draft tokens | the first n verified] = Σ_{t<=n} s_t

A confidence head (DSpark's) fills `Draft.confidence`; otherwise `lattice_confidence` reads it off the
lattice the selector walked (the pick's softmax over the K successors), which reads token t's own
probability, so at T > 0 it is for analysis, never for sizing verification. Neither is calibrated:
`Calibrator` maps raw values onto the acceptances observed online (per position and confidence bin,
shrunk to the raw value while a bin is young), and `table()` is the calibration plot's data. A token
tree has no per-node signal: `NodeRates` counts how often each node index of a best-first tree is
accepted. `RoundCounts` keeps the accepted tokens of full-width rounds. The verifier reads none of it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def survival(confidence: Tensor) -> Tensor:
    """c [..., L] → s [..., L], s_t = Π_{u<=t} c_u (float32 or wider)."""
    return confidence.to(torch.promote_types(confidence.dtype, torch.float32)).clamp(0, 1).cumprod(dim=-1)


def expected_accepted(confidence: Tensor) -> Tensor:
    """c [..., L] → [..., L + 1]: the expected number of accepted draft tokens when the first n are
    verified, for n = 0..L (0 for n = 0; the target's own token comes on top of each)."""
    s = survival(confidence)
    return torch.cat([s.new_zeros(*s.shape[:-1], 1), s.cumsum(dim=-1)], dim=-1)


def lattice_confidence(first: Tensor, steps: Tensor, index: Tensor, temperature: float = 1.0) -> Tensor:
    """The walk's own estimate along a path: first [..., K], steps [..., L-1, K, K], index [..., L] (the
    picked candidate at each position) → c [..., L], c_t = softmax(scores of t's successors / T)[pick_t]
    given the pick before it (T: the scale the scores are read at; 1 for the raw lattice)."""
    scale = max(float(temperature), 1e-6)
    p0 = torch.softmax(first.float() / scale, dim=-1).gather(-1, index[..., :1])  # [..., 1]
    if index.shape[-1] == 1:
        return p0
    rows = steps.float().gather(-2, index[..., :-1, None, None].expand(*steps.shape[:-2], 1, steps.shape[-1]))
    rows = rows[..., 0, :]  # [..., L-1, K]: the scores of t's successors given the pick at t-1
    p = torch.softmax(rows / scale, dim=-1).gather(-1, index[..., 1:, None])[..., 0]  # [..., L-1]
    return torch.cat([p0, p], dim=-1)


class RoundCounts:
    """How many draft tokens the rounds verified at full width accepted: their number, sum and sum of
    squares (the sample mean and variance of a round's accepted tokens, per row-round)."""

    __slots__ = ("n", "total", "squares")

    def __init__(self) -> None:
        self.n, self.total, self.squares = 0, 0.0, 0.0

    def add(self, accepted: int) -> None:
        self.n += 1
        self.total += accepted
        self.squares += accepted * accepted

    def variance(self) -> float | None:
        """The sample variance of the accepted tokens (None before two rounds)."""
        if self.n < 2:
            return None
        mean = self.total / self.n
        return max(0.0, (self.squares - self.n * mean * mean) / (self.n - 1))


class Calibrator:
    """Raw confidences → calibrated ones, learned from what verification accepted.

    Per draft position t < positions and per bin of the raw value (`bins` equal-width bins of [0, 1]):
    n (tokens verified with every token before them accepted) and a (those accepted). calibrate(c) at t
    = (a + m · c) / (n + m): the raw value until a bin has seen about m tokens, the observed rate after.
    A round that verified n tokens and accepted k observes positions 0..min(k, n-1): 1..k accepted,
    k+1 rejected (when k < n); positions past the first rejection are not observed (c is conditional).
    """

    def __init__(self, positions: int, bins: int = 10, prior_strength: float = 8.0) -> None:
        if positions < 1 or bins < 1 or prior_strength <= 0:
            raise ValueError(f"Calibrator needs positions >= 1, bins >= 1 and prior_strength > 0, got "
                             f"{positions}, {bins}, {prior_strength}")
        self.bins, self.prior_strength = bins, prior_strength
        self.seen = torch.zeros(positions, bins, dtype=torch.float64)
        self.accepted = torch.zeros(positions, bins, dtype=torch.float64)
        self.predicted = torch.zeros(positions, bins, dtype=torch.float64)  # sum of raw c, for the table
        self.full = RoundCounts()  # the rounds that verified every position

    def _bin(self, confidence: Tensor) -> Tensor:
        return (confidence.double().clamp(0, 1) * self.bins).long().clamp(max=self.bins - 1)

    def observe(self, confidence: Tensor, num_verified: int, num_accepted: int) -> None:
        """confidence [L] raw values of a round's draft; the first num_verified were verified and the
        first num_accepted of those accepted."""
        if not 0 <= num_accepted <= num_verified <= confidence.shape[0]:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= verified ({num_verified}) <= L "
                             f"({confidence.shape[0]})")
        if num_verified >= self.seen.shape[0]:
            self.full.add(min(num_accepted, self.seen.shape[0]))
        observed = min(num_accepted + 1, num_verified, self.seen.shape[0])
        if observed == 0:
            return
        c = confidence[:observed].detach().cpu().double()
        cell = torch.arange(observed) * self.bins + self._bin(c)  # (position, bin) flattened: distinct cells
        self.seen.view(-1).index_add_(0, cell, torch.ones(observed, dtype=torch.float64))
        self.accepted.view(-1).index_add_(0, cell[:num_accepted], torch.ones(min(num_accepted, observed),
                                                                               dtype=torch.float64))
        self.predicted.view(-1).index_add_(0, cell, c)

    def calibrate(self, confidence: Tensor) -> Tensor:
        """c [..., L] raw → [..., L] calibrated (positions past the table's reuse its last row)."""
        L = confidence.shape[-1]
        t = torch.arange(L).clamp(max=self.seen.shape[0] - 1).expand_as(confidence)
        c = confidence.detach().cpu().double()
        b = self._bin(c)
        n, a = self.seen[t, b], self.accepted[t, b]
        out = (a + self.prior_strength * c) / (n + self.prior_strength)
        return out.to(device=confidence.device, dtype=torch.promote_types(confidence.dtype, torch.float32))

    def calibrate_at(self, t: int, confidence: float) -> float:
        """calibrate() of one raw value at position t (a Python float: a policy reads them one at a time)."""
        t = min(t, self.seen.shape[0] - 1)
        b = min(int(min(max(confidence, 0.0), 1.0) * self.bins), self.bins - 1)
        n, a = float(self.seen[t, b]), float(self.accepted[t, b])
        return (a + self.prior_strength * confidence) / (n + self.prior_strength)

    def table(self) -> list[dict]:
        """One entry per (position, bin) that saw a token: predicted (mean raw c), observed (acceptance
        rate), count."""
        rows = []
        for t, b in zip(*torch.nonzero(self.seen, as_tuple=True)):
            n = float(self.seen[t, b])
            rows.append(dict(position=int(t), bin=int(b), count=int(n), predicted=float(self.predicted[t, b]) / n,
                             observed=float(self.accepted[t, b]) / n))
        return rows


class NodeRates:
    """Each node index's acceptance rate in best-first token trees: a_i = P(node i lies on the path
    the verifier accepts), = (accepted_i + m · prior) / (seen_i + m), the prior until index i has been
    verified about m times. Node i's verdict depends on nodes 0..i-1 only (its ancestors and the
    siblings tried before it, all earlier in best-first order), so a round that verified the first n
    nodes observes indices 0..n-1 as any larger tree would have them.

    The prior counts as m = 2 rounds by default: a policy starts from an optimistic prior on every
    node (so that it drafts, and learns), and each drafting round observes every node it verified.
    With m = 8, 15-node trees on the embedded pair at T = 1 kept drafting for over a hundred rounds
    that lost to plain steps before the deep nodes' prior washed out (docs/architecture.md,
    "Performance choices")."""

    def __init__(self, nodes: int, prior: float, prior_strength: float = 2.0) -> None:
        if nodes < 1 or not 0 <= prior <= 1 or prior_strength <= 0:
            raise ValueError(f"NodeRates needs nodes >= 1, 0 <= prior <= 1 and prior_strength > 0, got "
                             f"{nodes}, {prior}, {prior_strength}")
        self.prior, self.prior_strength = prior, prior_strength
        # counts as Python lists: a policy reads and updates them every round, a few dozen numbers, where
        # each tensor operation would cost more than the arithmetic
        self._seen = [0] * nodes  # rounds that verified node i
        self._accepted = [0] * nodes  # ... and accepted it
        self._rates: list[float] | None = None  # rate_list(), until the next observe
        self.full = RoundCounts()  # the rounds that verified every node

    @property
    def nodes(self) -> int:
        return len(self._seen)

    @property
    def seen(self) -> Tensor:
        """[nodes] float64: rounds that verified node i."""
        return torch.tensor(self._seen, dtype=torch.float64)

    @property
    def accepted(self) -> Tensor:
        """[nodes] float64: rounds that verified node i and accepted it."""
        return torch.tensor(self._accepted, dtype=torch.float64)

    def observe(self, num_verified: int, accepted: list[int]) -> None:
        """A round verified the first num_verified nodes and accepted `accepted` (node indices)."""
        if not 0 <= num_verified <= self.nodes or any(not 0 <= i < num_verified for i in accepted) \
                or len(set(accepted)) != len(accepted):
            raise ValueError(f"need distinct accepted nodes ({accepted}) among the {num_verified} verified, "
                             f"at most {self.nodes}")
        if num_verified == self.nodes:
            self.full.add(len(accepted))
        seen, taken = self._seen, self._accepted
        for i in range(num_verified):
            seen[i] += 1
        for i in accepted:
            taken[i] += 1
        self._rates = None

    def rate_list(self) -> list[float]:
        """a [nodes] as Python floats (what a policy reads every round)."""
        if self._rates is None:
            m, prior = self.prior_strength, self.prior
            self._rates = [(a + m * prior) / (n + m) for a, n in zip(self._accepted, self._seen)]
        return self._rates

    def rates(self) -> Tensor:
        """a [nodes] float64."""
        return torch.tensor(self.rate_list(), dtype=torch.float64)


__all__ = ["Calibrator", "NodeRates", "expected_accepted", "lattice_confidence", "survival"]
