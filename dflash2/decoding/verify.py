"""Lossless verification of one drafted block (docs/architecture.md, "Contracts"; docs/testing.md §1–§3).

Pure functions of the draft, the target's logits and a random source; no model in sight. The rules:

* greedy (temperature 0): accept while draft == argmax; at the first mismatch emit the argmax;
* deterministic path (`Draft.q_probs is None`: argmax, walk or Viterbi at T=0, any fixed path at
  T>0): q is one-hot, so draw X ~ p̃, accept iff X == d, and on mismatch emit X itself;
* stochastic path (the sampled walk, sparse q over K candidates): accept d with min(1, p̃(d)/q(d)),
  on rejection emit a draw from norm(max(0, p̃ - q)).

In all cases, when every draft token is accepted the bonus token is drawn from the position after
the last draft token. `commit` then applies stop tokens and the budget exactly as HF generate does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dflash2.decoding.rng import RandomSource
from dflash2.decoding.sampling import SamplingParams, greedy_token, process_logits


class Draft(NamedTuple):
    """A drafted path of L tokens after the anchor.

    tokens:  [L] long, the proposed tokens d_1..d_L.
    q_ids:   [L, K] long or None, the candidates each token was sampled among (stochastic drafts).
    q_probs: [L, K] float or None, the sampling distribution over q_ids (rows sum to 1). None means
             the path is deterministic given the context (q one-hot), which is what argmax, Viterbi
             and the walk at T=0 produce.
    confidence: [L] float in [0, 1] or None, the drafter's estimate for each token that the verifier
             accepts it given that every token before it was accepted (a confidence head's output,
             e.g. DSpark's); None: no estimate. Computed before token t is drawn: it may depend on
             the tokens before it, never on token t itself. Read by policies that size verification
             (dflash2.interfaces.VerifyPolicy); never by the verifier.
    """

    tokens: Tensor
    q_ids: Tensor | None = None
    q_probs: Tensor | None = None
    confidence: Tensor | None = None

    def truncate(self, length: int) -> "Draft":
        length = max(length, 0)
        if length >= self.tokens.shape[0]:
            return self
        cut = (lambda t: None if t is None else t[:length])
        return Draft(self.tokens[:length], cut(self.q_ids), cut(self.q_probs), cut(self.confidence))

    @property
    def stochastic(self) -> bool:
        return self.q_probs is not None


class Verdict(NamedTuple):
    """num_accepted draft tokens (0..L), then next_token: the correction or the bonus."""

    num_accepted: int
    next_token: int


def verify_block(draft: Draft, logits: Tensor, params: SamplingParams, rng: RandomSource) -> Verdict:
    """Verify a draft against the target's logits [L+1, V] for [anchor, d_1..d_L].

    logits[i] is the target's next-token distribution after d_i (after the anchor for i = 0).
    """
    L = draft.tokens.shape[0]
    if logits.shape[0] != L + 1:
        raise ValueError(f"expected logits for {L + 1} positions, got {logits.shape[0]}")
    if params.greedy:
        return verify_greedy(draft.tokens, logits)
    probs = process_logits(logits, params)
    if draft.stochastic:
        return verify_stochastic(draft, probs, rng)
    return verify_deterministic(draft.tokens, probs, rng)


def verify_greedy(tokens: Tensor, logits: Tensor) -> Verdict:
    """tokens [L], logits [L+1, V] → longest prefix equal to the target's argmax, then its argmax."""
    choice = greedy_token(logits)  # [L+1]
    matches = (tokens == choice[:-1]).long()
    n = int(matches.cumprod(0).sum().item())
    return Verdict(n, int(choice[n].item()))


def verify_deterministic(tokens: Tensor, probs: Tensor, rng: RandomSource) -> Verdict:
    """One-hot q: X_i ~ p̃_i, accept iff X_i == d_i, else emit X_i (never a fresh draw)."""
    drafted = tokens.tolist()
    for i, d in enumerate(drafted):
        x = rng.categorical(probs[i])
        if x != d:
            return Verdict(i, x)
    return Verdict(len(drafted), rng.categorical(probs[len(drafted)]))


def verify_stochastic(draft: Draft, probs: Tensor, rng: RandomSource) -> Verdict:
    """Sparse q: accept d_i with min(1, p̃(d_i)/q(d_i)); on rejection draw from norm(max(0, p̃ - q))."""
    assert draft.q_ids is not None and draft.q_probs is not None
    drafted = draft.tokens.tolist()
    for i, d in enumerate(drafted):
        q = torch.zeros_like(probs[i]).index_add_(0, draft.q_ids[i], draft.q_probs[i].to(probs.dtype))
        q_d, p_d = float(q[d]), float(probs[i, d])
        if q_d <= 0.0:
            raise ValueError(f"draft token {d} at position {i} has q = 0: it was not drawn from q")
        if rng.bernoulli(min(1.0, p_d / q_d)):
            continue
        residual = (probs[i] - q).clamp_min(0)
        mass = residual.sum()
        # mass == 0 would mean p̃ == q, where rejection has probability 0; guard rounding anyway.
        return Verdict(i, rng.categorical(residual / mass if mass > 0 else probs[i]))
    return Verdict(len(drafted), rng.categorical(probs[len(drafted)]))


def commit(draft_tokens: list[int], verdict: Verdict, budget: int, stop_token_ids: frozenset[int]
           ) -> tuple[list[int], bool]:
    """Tokens a round commits and whether a stop token ended generation.

    Accepted draft tokens plus the next token, cut to the remaining budget, then cut after the first
    stop token (the stop token itself is kept, as HF generate keeps EOS).
    """
    tokens = (draft_tokens[: verdict.num_accepted] + [verdict.next_token])[:budget]
    for j, t in enumerate(tokens):
        if t in stop_token_ids:
            return tokens[: j + 1], True
    return tokens, False
