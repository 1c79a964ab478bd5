"""Second line of defence: spec_generate with a real torch.Generator, sampled many times, against the
exact AR distribution (chi-square, fixed seeds). The exact proof is in test_exact_distribution.py."""

from __future__ import annotations

import functools

import pytest
import torch

import dflash2.decoding.verify as verify_mod
from dflash2 import DFlash2Drafter, SamplingParams, spec_generate
from dflash2.decoding.sampling import process_logits
from tests.helpers import exact_ar_distribution, tiny_target
from tests.decoding.test_exact_distribution import typical_acceptance

# 5 new tokens with blocks of 4: the first round verifies a full 3-token draft (the budget cuts drafts).
V, PROMPT, N_NEW, SAMPLES = 4, [1, 2, 3], 5, 3000


@functools.lru_cache(maxsize=None)
def pair():
    target = tiny_target("qwen3", vocab=V, seed=5, scale=2.0)
    torch.manual_seed(2)
    drafter = DFlash2Drafter.from_target(target, block_size=4, selector="walk", selector_top_k=3, selector_rank=4,
                                         mask_token_id=V - 1)
    torch.nn.init.normal_(drafter.candidate_selector.hidden_projection.weight, std=2.0)
    return drafter, target


def chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled. p = Q(df/2, x/2)."""
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for key, p in probs.items():
        exp, obs = n * p, counts.get(key, 0)
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
        else:
            cells.append((obs, exp))
    assert set(counts) <= set(probs), "an outcome the target cannot produce"
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_counts(params: SamplingParams, seed: int) -> dict:
    drafter, target = pair()
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    lengths: list[int] = []
    for _ in range(SAMPLES):
        out = spec_generate(drafter, target, torch.tensor([PROMPT]), max_new_tokens=N_NEW,
                            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, generator=g)
        key = tuple(out.new_tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        lengths += out.acceptance_lengths
    histogram = {n: lengths.count(n) for n in sorted(set(lengths))}
    print(f"acceptance lengths over {SAMPLES} runs: {histogram}")
    assert max(histogram) >= 3, "drafts are (almost) never accepted: the test would be hollow"
    return counts


# the default run samples one setting (the exact proof covers every setting); -m slow adds T = 1 and the
# check that this test has the power to fail
@pytest.mark.parametrize("params", [pytest.param(SamplingParams(1.0), marks=pytest.mark.slow),
                                    SamplingParams(0.8, top_k=4, top_p=0.9)], ids=str)
def test_spec_generate_matches_ar_distribution(params):
    _, target = pair()
    exact = exact_ar_distribution(target, PROMPT, N_NEW, lambda logits: process_logits(logits, params))
    p = chi_square_p_value(sample_counts(params, seed=0), exact, SAMPLES)
    print(f"{params}: chi-square p = {p:.3f}")
    assert p > 1e-3


@pytest.mark.slow
def test_chi_square_has_power_against_a_mutant(monkeypatch):
    """The exact tests catch subtler mutants; at 3000 samples this one is far outside the noise."""
    monkeypatch.setattr(verify_mod, "verify_stochastic", lambda draft, probs, rng: typical_acceptance(draft.tokens, probs, rng))
    params = SamplingParams(1.0)
    _, target = pair()
    exact = exact_ar_distribution(target, PROMPT, N_NEW, lambda logits: process_logits(logits, params))
    assert chi_square_p_value(sample_counts(params, seed=0), exact, SAMPLES) < 1e-3
