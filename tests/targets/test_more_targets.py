"""More attention targets through the same adapter: MoE, Gemma-3 (embedding scaling, sliding and
global layers, soft-capping), gpt-oss (sinks, sliding layers, MoE) and tied embeddings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2 import DFlash2Drafter, spec_generate
from tests.helpers import MASK, MORE_ARCHITECTURES, VOCAB, hf_greedy, oracle_drafter, tiny_target
from tests.decoding.test_greedy_equality import check_round_invariants


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
@settings(max_examples=12)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), block_size=st.integers(1, 12),
       kind=st.sampled_from(["dflash2", "dflash1", "oracle_partial"]), budget=st.integers(1, 20))
def test_greedy_equals_hf_generate(arch, prompt, block_size, kind, budget):
    target = tiny_target(arch)
    reference = hf_greedy(target, prompt, budget)
    if kind == "oracle_partial":
        drafter = oracle_drafter(block_size, reference, corrupt_every=4)
    else:
        torch.manual_seed(0)
        variant = dict(conv="two_tap", selector="walk") if kind == "dflash2" else dict(conv="none", selector="argmax")
        drafter = DFlash2Drafter.from_target(target, block_size=block_size, mask_token_id=MASK, selector_top_k=4,
                                             selector_rank=8, **variant)
    result = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=budget)
    assert result.sequences[0].tolist() == reference
    check_round_invariants(result, block_size, budget, set())


@pytest.mark.parametrize("arch", MORE_ARCHITECTURES)
def test_sliding_window_shorter_than_the_generation_with_partial_acceptance(arch):
    target, prompt = tiny_target(arch), [3, 1, 4, 1, 5, 9, 2, 6]
    reference = hf_greedy(target, prompt, 30)
    result = spec_generate(oracle_drafter(8, reference, corrupt_every=4), target, torch.tensor([prompt]),
                           max_new_tokens=30)
    assert result.sequences[0].tolist() == reference
    assert 1 < max(result.acceptance_lengths) < 8
