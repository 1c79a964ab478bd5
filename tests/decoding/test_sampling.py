"""Sampling semantics are HF generate's: temperature → top-k → top-p, same ties kept; at top-p's edge equal
scores are dropped in index order (dflash2/decoding/sampling.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash2 import SamplingParams
from dflash2.decoding.sampling import greedy_token, process_logits


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = logits[None]
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    return scores.softmax(-1)[0]


@settings(max_examples=300)
@given(values=st.lists(st.integers(-6, 6), min_size=1, max_size=12),  # small integers: plenty of ties
       scale=st.sampled_from([0.5, 1.0, 3.0]),
       temperature=st.floats(0.05, 4.0), top_k=st.integers(0, 14), top_p=st.floats(0.01, 1.0))
def test_process_logits_matches_hf_warpers(values, scale, temperature, top_k, top_p):
    logits = torch.tensor(values, dtype=torch.float64) * scale
    params = SamplingParams(temperature, top_k, top_p)
    torch.testing.assert_close(process_logits(logits, params), hf_probs(logits, params), rtol=0, atol=1e-15)


def test_process_logits_batched_rows_equal_single_rows():
    logits = torch.randn(5, 30, dtype=torch.float64)
    params = SamplingParams(0.8, 7, 0.9)
    batched = process_logits(logits, params)
    for i in range(5):
        torch.testing.assert_close(batched[i], process_logits(logits[i], params), rtol=0, atol=0)


def test_greedy_is_first_argmax_among_ties():
    assert greedy_token(torch.tensor([1.0, 3.0, 3.0, 0.0])).item() == 1


def test_process_logits_refuses_greedy():
    with pytest.raises(ValueError, match="greedy"):
        process_logits(torch.zeros(3), SamplingParams(0.0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def stable_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's temperature → top-k → top-p over the whole row, its sort made stable: equal scores at
    top-p's edge dropped in index order."""
    scores = logits / p.temperature
    if p.top_k:
        scores = scores.masked_fill(scores < torch.topk(scores, min(p.top_k, scores.shape[-1]))[0][..., -1:], -math.inf)
    if p.top_p < 1.0:
        ordered, idx = torch.sort(scores, stable=True)
        remove = ordered.softmax(-1).cumsum(-1) <= 1 - p.top_p
        remove[..., -1:] = False
        scores = scores.masked_fill(torch.zeros_like(remove).scatter(-1, idx, remove), -math.inf)
    return scores.softmax(-1)


@pytest.mark.parametrize("top_k, top_p", [(20, 0.95), (50, 0.5), (3, 0.99), (600, 0.9), (0, 0.9)])
def test_process_logits_over_a_vocabulary_is_hfs_up_to_which_tie_is_dropped(top_k, top_p):
    """Rows of 600 logits on a coarse grid (ties at the k-th score and at top-p's edge), rows keeping
    different numbers of tied scores: the probabilities are HF's as a multiset (a tie at top-p's edge
    may drop another token of the same score), and exactly those of a whole-row stable sort (top-p
    reads only the kept columns when top-k is on)."""
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randint(-40, 40, (6, 600), generator=g).to(torch.float64) / 8
    params = SamplingParams(0.7, top_k, top_p)
    got = process_logits(logits, params)
    torch.testing.assert_close(got, stable_reference(logits, params), rtol=0, atol=1e-15)
    for i in range(logits.shape[0]):
        torch.testing.assert_close(got[i].sort()[0], hf_probs(logits[i], params).sort()[0], rtol=0, atol=1e-15)


def test_torch_random_draws_each_index_at_its_probability_and_never_one_of_zero_mass(monkeypatch):
    """TorchRandom.categorical (inverse transform over the float64 cumulative mass): 200k draws over a
    vocabulary with zero-mass gaps and ends match the probabilities (each count within 5 standard
    deviations, seeded), never an index of zero mass; a uniform that lands on the total (rounding) gives
    the last index with mass, not one past the vocabulary."""
    import dflash2.decoding.rng as rng

    probs = torch.zeros(4096)
    probs[[0, 7, 8, 1000, 4000]] = torch.tensor([0.05, 0.4, 0.25, 0.2999, 0.0001])
    source = rng.TorchRandom(torch.Generator().manual_seed(0))
    n = 200_000
    counts = torch.bincount(torch.tensor([source.categorical(probs) for _ in range(n)]), minlength=4096)
    assert int(counts[probs == 0].sum()) == 0
    expected = n * probs
    assert bool(((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1).all()), counts[probs > 0]
    monkeypatch.setattr(rng.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert source.categorical(probs) == 4000


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_torch_random_draws_rows_as_it_draws_them_one_by_one(rows, monkeypatch):
    """TorchRandom.categorical_rows (the batched plain step's draw) draws what categorical draws row by
    row from the same generator, and leaves the generator where those calls leave it; a uniform that
    lands on a row's total gives that row's last index with mass; a source without it (a test's
    enumerating source) is asked row by row."""
    import dflash2.decoding.rng as rng

    g = torch.Generator().manual_seed(rows)
    probs = torch.softmax(3 * torch.randn(rows, 4096, generator=g), -1)
    probs[:, 4000:] = 0  # zero mass at the end of every row
    batched, single = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    drawn = rng.TorchRandom(batched).categorical_rows(probs)
    assert drawn == [rng.TorchRandom(single).categorical(p) for p in probs]
    assert torch.rand((), generator=batched).item() == torch.rand((), generator=single).item()
    monkeypatch.setattr(rng.torch, "rand", lambda *a, **k: torch.ones(rows, dtype=torch.float64))
    assert rng.TorchRandom().categorical_rows(probs) == [3999] * rows

    class RowByRow:
        asked = 0

        def categorical(self, p):
            RowByRow.asked += 1
            return int(p.argmax())
    assert rng.categorical_rows(RowByRow(), probs) == probs.argmax(-1).tolist() and RowByRow.asked == rows
