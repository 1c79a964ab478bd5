"""Sampling is lossless: the exact output distribution of spec_generate equals the AR distribution.

Every random decision of drafting and verification goes through the injected RandomSource; the
enumerator runs spec_generate once per branch of those decisions, on a real tiny float64 HF target
with a 4-token vocabulary, and sums branch probabilities per output. The AR distribution is computed
independently by brute force over all continuations. Then the same harness runs deliberately broken
verifiers and drafters (mutants), and must see each one deviate.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dflash2.decoding.verify as verify_mod
from dflash2 import DFlash2Drafter, Draft, SamplingParams, spec_generate
from dflash2.decoding.sampling import process_logits
from dflash2.decoding.verify import Verdict
from tests.helpers import (StubDrafter, constant_drafter, enumerate_outcomes, exact_ar_distribution, max_abs_diff,
                           tiny_drafter, tiny_target)

# 4 new tokens with blocks of 3: the first round verifies a full 2-token draft plus its bonus.
V, PROMPT, N_NEW, BLOCK = 3, [1, 2], 4, 3
EXACT, DETECT = 1e-12, 1e-4


@functools.lru_cache(maxsize=None)
def target():
    return tiny_target("qwen3", vocab=V, seed=3)


def dflash(selector: str, top_k: int = 2, conv: str = "two_tap") -> DFlash2Drafter:
    # a non-trivial pairwise term, so the walk's q depends on its path
    return tiny_drafter("qwen3", BLOCK, seed=11, vocab=V, target_seed=3, pairwise_std=3.0 if selector != "argmax" else 0.0,
                        selector=selector, selector_top_k=top_k, selector_rank=4, mask_token_id=V - 1, conv=conv,
                        lilicorr_num_layers=1, lilicorr_factor_dim=8, confidence_head=selector == "dspark")


def spec_distribution(drafter, params: SamplingParams, stops=(), lengths: set | None = None, tgt=None, policy=None):
    """Exact output distribution and branch count; `lengths` collects every round's acceptance length.
    tgt: the target as spec_generate gets it (default: the HF model; tests/targets/test_static.py
    passes a StaticTarget). policy: a factory of the verification policy each branch runs with."""
    def program(rng):
        out = spec_generate(drafter, tgt or target(), torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            stop_token_ids=list(stops), rng=rng, policy=policy() if policy else None)
        if lengths is not None:
            lengths.update(out.acceptance_lengths)
        return tuple(out.new_tokens.tolist())

    return enumerate_outcomes(program)


def ar_distribution(params: SamplingParams, stops=()):
    return exact_ar_distribution(target(), PROMPT, N_NEW, lambda logits: process_logits(logits, params), frozenset(stops))


PARAMS = {
    "T1": SamplingParams(1.0),
    "T0.7_topk2": SamplingParams(0.7, top_k=2),
    "T1.3_topp0.8": SamplingParams(1.3, top_p=0.8),
    "T1_topk2_topp0.9": SamplingParams(1.0, top_k=2, top_p=0.9),
}
DRAFTERS = {
    "fixed_path": lambda: constant_drafter(BLOCK, 0),
    "fixed_path_mask_id": lambda: constant_drafter(BLOCK, V - 1),
    "argmax": lambda: dflash("argmax"),
    "viterbi": lambda: dflash("viterbi"),
    "sampled_walk_sparse_q": lambda: dflash("walk", top_k=2),
    "sampled_walk_full_q": lambda: dflash("walk", top_k=V),
    "sampled_dspark": lambda: dflash("dspark", conv="none"),
    "sampled_lilicorr_v1": lambda: dflash("lilicorr", conv="none"),
    "sampled_lilicorr_v2": lambda: dflash("lilicorr"),
}


# the full-q walk branches 4096 ways at T=1; two truncated settings cover it. The method drafters (DSpark,
# LiLiCorr) at T1.3_topp0.8, and LiLiCorr v1 (v2 without the convolution) at T1, repeat what the other
# settings and drafters check; they run with -m slow.
DEEP = {("sampled_dspark", "T1.3_topp0.8"), ("sampled_lilicorr_v1", "T1.3_topp0.8"),
        ("sampled_lilicorr_v2", "T1.3_topp0.8"), ("sampled_lilicorr_v1", "T1")}
CASES = [pytest.param(d, p, marks=[pytest.mark.slow] if (d, p) in DEEP else []) for d in DRAFTERS for p in PARAMS
         if not (d == "sampled_walk_full_q" and p in ("T1", "T1.3_topp0.8"))]


@pytest.mark.parametrize("drafter_name, params_name", CASES)
def test_exact_distribution(drafter_name, params_name, record_property):
    params, lengths = PARAMS[params_name], set()
    got, branches = spec_distribution(DRAFTERS[drafter_name](), params, lengths=lengths)
    want = ar_distribution(params)
    record_property("branches", branches)
    print(f"{drafter_name} {params_name}: {branches} branches, {len(want)} outcomes, round lengths {sorted(lengths)}")
    assert abs(sum(got.values()) - 1.0) < EXACT
    assert max_abs_diff(got, want) < EXACT
    assert max(lengths) >= 2, "no branch accepted a draft token: the test would be hollow"


def test_exact_distribution_with_stop_token():
    params = SamplingParams(1.0)
    for name in ("fixed_path", "sampled_walk_sparse_q"):
        got, _ = spec_distribution(DRAFTERS[name](), params, stops=(0,))
        assert max_abs_diff(got, ar_distribution(params, stops=(0,))) < EXACT


def test_exact_distribution_block_of_four():
    params = SamplingParams(0.9, top_k=2)
    d = dflash("walk", top_k=2).config
    drafter = DFlash2Drafter(d.replace(block_size=4)).double()
    with torch.no_grad():
        torch.nn.init.normal_(drafter.candidate_selector.hidden_projection.weight, std=3.0)
    got, _ = spec_distribution(drafter, params)
    assert max_abs_diff(got, ar_distribution(params)) < EXACT


def test_exact_distribution_with_a_draft_vocabulary():
    """The walk samples among tokens {0, 2} only (token 1 is never drafted): still the AR distribution."""
    params, lengths = PARAMS["T0.7_topk2"], set()
    drafter = dflash("walk", top_k=2).with_draft_vocab([0, 2])
    got, _ = spec_distribution(drafter, params, lengths=lengths)
    assert max_abs_diff(got, ar_distribution(params)) < EXACT
    assert max(lengths) >= 2, "no branch accepted a draft token: the test would be hollow"


# -- mutants: each must be caught ----------------------------------------------------------------------
def fresh_resample_deterministic(tokens, probs, rng):
    for i, d in enumerate(tokens.tolist()):
        if rng.categorical(probs[i]) != d:
            return Verdict(i, rng.categorical(probs[i]))  # BUG: a fresh draw instead of X itself
    return Verdict(len(tokens), rng.categorical(probs[len(tokens)]))


def fresh_resample_stochastic(draft, probs, rng):
    for i, d in enumerate(draft.tokens.tolist()):
        q = torch.zeros_like(probs[i]).index_add_(0, draft.q_ids[i], draft.q_probs[i].to(probs.dtype))
        if not rng.bernoulli(min(1.0, float(probs[i, d] / q[d]))):
            return Verdict(i, rng.categorical(probs[i]))  # BUG: p̃ instead of the residual
    return Verdict(len(draft.tokens), rng.categorical(probs[len(draft.tokens)]))


def bonus_wrong_position(tokens, probs, rng):
    for i, d in enumerate(tokens.tolist()):
        x = rng.categorical(probs[i])
        if x != d:
            return Verdict(i, x)
    return Verdict(len(tokens), rng.categorical(probs[len(tokens) - 1]))  # BUG: off by one


def typical_acceptance(tokens, probs, rng):
    for i, d in enumerate(tokens.tolist()):
        if float(probs[i, d]) < 0.2:  # BUG: accept anything plausible enough
            return Verdict(i, rng.categorical(probs[i]))
    return Verdict(len(tokens), rng.categorical(probs[len(tokens)]))


class SoftmaxQForArgmaxDrafts(StubDrafter):
    """BUG in the drafter contract: tokens are argmaxes, but q claims softmax probabilities."""

    def __init__(self):
        super().__init__(BLOCK, lambda anchor, pos: [0] * (BLOCK - 1))

    def propose(self, cache, anchor, new_features, target, temperature, rng):
        tokens = super().propose(cache, anchor, new_features, target, temperature, rng).tokens
        q = torch.tensor([[0.6, 0.4]] * len(tokens), dtype=torch.float64)
        return Draft(tokens, torch.tensor([[0, 1]] * len(tokens)), q)


MUTANTS = {  # name: (function replaced, mutant, drafter, sampling)
    "fresh_resample_after_rejection": ("verify_deterministic", fresh_resample_deterministic, "fixed_path", "T1"),
    "fresh_resample_after_rejection_stochastic": ("verify_stochastic", fresh_resample_stochastic,
                                                  "sampled_walk_sparse_q", "T0.7_topk2"),
    "bonus_from_wrong_position": ("verify_deterministic", bonus_wrong_position, "fixed_path", "T1"),
    "typical_acceptance": ("verify_deterministic", typical_acceptance, "fixed_path", "T1"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_verifier_is_detected(mutant, monkeypatch):
    name, broken, drafter_name, params_name = MUTANTS[mutant]
    monkeypatch.setattr(verify_mod, name, broken)
    params = PARAMS[params_name]
    got, _ = spec_distribution(DRAFTERS[drafter_name](), params)
    deviation = max_abs_diff(got, ar_distribution(params))
    print(f"{mutant}: max deviation {deviation:.3g}")
    assert deviation > DETECT


def test_mutant_softmax_q_with_argmax_drafts_is_detected():
    params = PARAMS["T1"]
    got, _ = spec_distribution(SoftmaxQForArgmaxDrafts(), params)
    assert max_abs_diff(got, ar_distribution(params)) > DETECT
