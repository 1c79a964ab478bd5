"""Sampling semantics are exactly HF generate's: temperature → top-k → top-p, same ties, same order."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash2 import SamplingParams
from dflash2.sampling import greedy_token, process_logits


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
