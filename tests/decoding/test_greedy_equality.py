"""Greedy spec_generate equals HF `generate(do_sample=False)` token for token, and keeps the per-round
invariants, for tiny float64 targets of several architectures and every drafter we can think of."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash2 import DFlash2Drafter, ar_generate, spec_generate
from tests.helpers import (ARCHITECTURES, MASK, VOCAB, constant_drafter, eos_spammer, hf_greedy, oracle_drafter,
                           random_drafter, tiny_drafter, tiny_target)

DFLASH_VARIANTS = [(conv, sel) for conv in ("two_tap", "none") for sel in ("walk", "viterbi", "argmax", "dspark", "lilicorr")]
STUBS = ("constant", "random", "oracle", "oracle_partial", "eos_spammer", "dflash_draft_len")


def dflash_drafter(arch: str, block_size: int, conv: str, selector: str, mask: int = MASK) -> DFlash2Drafter:
    return tiny_drafter(arch, block_size, seed=block_size, conv=conv, selector=selector, selector_top_k=4,
                        selector_rank=8, mask_token_id=mask, num_layers=2, pairwise_std=1.0 if selector == "dspark" else 0.0,
                        lilicorr_num_layers=1, lilicorr_factor_dim=8, confidence_head=selector == "dspark")


def make_drafter(kind, arch, block_size, reference, stop):
    if isinstance(kind, tuple):
        return dflash_drafter(arch, block_size, *kind)
    return {
        "constant": lambda: constant_drafter(block_size, 3),
        "random": lambda: random_drafter(block_size, VOCAB, seed=block_size),
        "oracle": lambda: oracle_drafter(block_size, reference),
        "oracle_partial": lambda: oracle_drafter(block_size, reference, corrupt_every=5),
        "eos_spammer": lambda: eos_spammer(block_size, stop if stop is not None else 1),
        "dflash_draft_len": lambda: dflash_drafter(arch, block_size, "two_tap", "viterbi").with_config(
            draft_len=max(1, block_size // 3)),  # proposes fewer tokens than its block
    }[kind]()


def check_round_invariants(result, block_size: int, max_new_tokens: int, stops: set[int]) -> None:
    new = result.new_tokens.tolist()
    assert len(new) <= max_new_tokens
    assert all(1 <= n <= block_size for n in result.acceptance_lengths)
    if new:
        assert len(new) == 1 + sum(result.acceptance_lengths)
    hits = [i for i, t in enumerate(new) if t in stops]
    assert hits in ([], [len(new) - 1]), "tokens after a stop token"
    assert (result.finish_reason == "stop") == bool(hits)
    if not hits:
        assert len(new) == max_new_tokens


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=30)
@given(data=st.data(),
       prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       block_size=st.integers(1, 16),
       drafter_kind=st.sampled_from(DFLASH_VARIANTS + list(STUBS)),
       budget=st.integers(0, 24))
def test_greedy_equals_hf_generate(arch, data, prompt, block_size, drafter_kind, budget):
    target = tiny_target(arch)
    reference = hf_greedy(target, prompt, max(budget, 1))
    stop = data.draw(st.none() | st.integers(0, len(reference) - len(prompt) - 1).map(lambda i: reference[len(prompt) + i]),
                     label="stop token (taken from the greedy continuation)")
    stops = [stop] if stop is not None else None
    expected = hf_greedy(target, prompt, budget, stops) if budget > 0 else prompt
    drafter = make_drafter(drafter_kind, arch, block_size, reference, stop)
    result = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=budget, stop_token_ids=stops)
    assert result.sequences[0].tolist() == expected
    check_round_invariants(result, block_size, budget, set(stops or ()))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_oracle_drafter_accepts_whole_blocks(arch):
    """The equality above must not pass by rejecting everything: an oracle is accepted in full."""
    target, prompt, block = tiny_target(arch), [5, 9, 2, 7], 8
    reference = hf_greedy(target, prompt, 33)
    result = spec_generate(oracle_drafter(block, reference), target, torch.tensor([prompt]), max_new_tokens=33)
    assert result.sequences[0].tolist() == reference
    assert result.acceptance_lengths == [block] * 4


def test_partial_acceptance_is_exercised():
    target, prompt = tiny_target("qwen3"), [4, 4, 8]
    reference = hf_greedy(target, prompt, 40)
    result = spec_generate(oracle_drafter(16, reference, corrupt_every=5), target, torch.tensor([prompt]),
                           max_new_tokens=40)
    assert result.sequences[0].tolist() == reference
    assert len(set(result.acceptance_lengths)) > 1 and max(result.acceptance_lengths) > 1


def test_ar_generate_equals_hf_generate():
    for arch in ARCHITECTURES:
        target = tiny_target(arch)
        for prompt in ([1], [3, 1, 4, 1, 5, 9, 2, 6]):
            result = ar_generate(target, torch.tensor([prompt]), max_new_tokens=20)
            assert result.sequences[0].tolist() == hf_greedy(target, prompt, 20)
            assert result.acceptance_lengths == [1] * 19


def test_output_tokens_equal_to_mask_id_survive():
    """A drafter whose mask id is a token the target actually emits must not lose or alter it."""
    target, prompt = tiny_target("qwen3"), [2, 3, 5, 7, 11]
    reference = hf_greedy(target, prompt, 30)
    new = reference[len(prompt):]
    mask = max(set(new), key=new.count)
    for conv, selector in DFLASH_VARIANTS:
        drafter = dflash_drafter("qwen3", 6, conv, selector, mask=mask)
        assert drafter.config.mask_token_id == mask
        result = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=30)
        assert result.sequences[0].tolist() == reference
        assert mask in result.new_tokens.tolist()
    result = spec_generate(constant_drafter(6, mask), target, torch.tensor([prompt]), max_new_tokens=30,
                           stop_token_ids=[mask])
    assert result.sequences[0].tolist() == hf_greedy(target, prompt, 30, [mask])
    assert result.new_tokens.tolist()[-1] == mask


@pytest.mark.parametrize("verify", ["path", "tree"])
def test_half_precision_drafter_stays_lossless_and_useful(verify):
    """A bfloat16 drafter for a float32 target (the embedded pair): what is committed is still the
    target's greedy output, and the drafts still get accepted (the head copy in bfloat16 is right)."""
    from dflash2.embedded import load_embedded

    tok, target, drafter = load_embedded()
    drafter = drafter.to(torch.bfloat16)
    lengths = []
    for prompt in ("def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "import os\n\n\ndef list_files(path):\n"):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = spec_generate(drafter, target, ids, max_new_tokens=48, verify=verify, tree_nodes=15)
        assert torch.equal(out.sequences, ar_generate(target, ids, max_new_tokens=48).sequences)
        lengths += out.acceptance_lengths
    assert sum(lengths) / len(lengths) > 2.0


def test_head_copy_in_another_dtype_follows_the_head():
    from dflash2 import TargetAdapter

    target = copy.deepcopy(tiny_target("qwen3"))  # its head is changed below; the shared one must not be
    adapter = TargetAdapter(target)
    head = target.get_output_embeddings()
    h = torch.randn(3, head.weight.shape[1], dtype=torch.float64)
    assert torch.equal(adapter.lm_logits(h), head(h))  # same dtype: the head itself
    low = adapter.lm_logits(h.float())
    assert low.dtype == torch.float32 and torch.allclose(low.double(), head(h), atol=1e-5)
    with torch.no_grad():
        head.weight.mul_(2.0)  # a changed head is cast again
    assert torch.allclose(adapter.lm_logits(h.float()).double(), head(h), atol=1e-5)
