"""A drafter written by a third party against `dflash2.Drafter` alone decodes losslessly, and the
loops pick what a drafter can do from the declared interfaces (dflash2/interfaces.py), nothing else."""

from __future__ import annotations

import pytest
import torch

import dflash2
from dflash2 import Draft, SamplingParams, spec_generate, spec_generate_batch
from dflash2.decoding.sampling import process_logits
from tests.helpers import enumerate_outcomes, exact_ar_distribution, hf_greedy, max_abs_diff, tiny_target


class RepeatDrafter:
    """A third-party heuristic: every draft token repeats the anchor; at T > 0 each is drawn from
    q = 0.7 on the anchor, 0.3 on the anchor + 1. Reads no target layer, imports only Draft."""

    def __init__(self, block_size: int, vocab: int) -> None:
        self.block_size, self.vocab = block_size, vocab
        self.target_layer_ids: tuple[int, ...] = ()

    def new_cache(self) -> None:
        return None

    def propose(self, cache, anchor, new_features, target, temperature, rng) -> Draft:
        L = self.block_size - 1
        if temperature == 0:
            return Draft(torch.full((L,), anchor, dtype=torch.long))
        ids = torch.tensor([[anchor, (anchor + 1) % self.vocab]] * L)
        q = torch.tensor([[0.7, 0.3]] * L, dtype=torch.float64)
        return Draft(torch.stack([ids[i, rng.categorical(q[i])] for i in range(L)]), ids, q)


def test_the_interfaces_are_exported_and_describe_the_drafters():
    drafter = RepeatDrafter(4, 48)
    assert isinstance(drafter, dflash2.Drafter)
    assert not isinstance(drafter, dflash2.TreeDrafter) and not isinstance(drafter, dflash2.BatchDrafter)
    ours = dflash2.DFlash2Drafter.from_target(tiny_target(), block_size=4, mask_token_id=47, selector_rank=4)
    for interface in (dflash2.Drafter, dflash2.TreeDrafter, dflash2.BatchDrafter, dflash2.CheckedDrafter):
        assert isinstance(ours, interface)
    for kind in ("argmax", "walk", "viterbi"):  # every selector has the lattice and the batched path
        assert isinstance(ours.with_config(selector=kind).candidate_selector, dflash2.Selector)
    assert isinstance(dflash2.AutoregressiveDrafter(), dflash2.TreeDrafter)


def test_a_third_party_drafter_is_lossless_greedy_single_and_batched():
    model = tiny_target("qwen3")
    drafter = RepeatDrafter(4, 48)
    prompts = [[3, 7, 7, 7, 1], [9, 2]]
    for prompt in prompts:
        out = spec_generate(drafter, model, torch.tensor([prompt]), max_new_tokens=12)
        assert out.sequences[0].tolist() == hf_greedy(model, prompt, 12)
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    batched = spec_generate_batch(drafter, model, ids, mask, max_new_tokens=12)
    assert [r.sequences[0].tolist() for r in batched] == [hf_greedy(model, p, 12) for p in prompts]


def test_a_third_party_drafter_samples_the_targets_distribution():
    V, prompt, n = 3, [1, 2], 4
    model = tiny_target("qwen3", vocab=V, seed=3)
    params = SamplingParams(1.0)

    def program(rng):
        out = spec_generate(RepeatDrafter(3, V), model, torch.tensor([prompt]), max_new_tokens=n, temperature=1.0,
                            rng=rng)
        return tuple(out.new_tokens.tolist())

    ours, branches = enumerate_outcomes(program)
    exact = exact_ar_distribution(model, prompt, n, lambda logits: process_logits(logits, params))
    assert branches > 10 and max_abs_diff(ours, exact) < 1e-12


def test_what_a_drafter_lacks_is_said_before_any_pass():
    model = tiny_target("qwen3")
    with pytest.raises(ValueError, match="needs a dflash2.TreeDrafter"):
        spec_generate(RepeatDrafter(4, 48), model, torch.tensor([[1, 2]]), max_new_tokens=4, verify="tree")

    class NoPropose:
        block_size, target_layer_ids = 4, ()

        def new_cache(self):
            return None

    with pytest.raises(TypeError, match=r"must be a dflash2.Drafter \(block_size, target_layer_ids, new_cache, propose\)"):
        spec_generate(NoPropose(), model, torch.tensor([[1, 2]]), max_new_tokens=4)
    with pytest.raises(TypeError, match="swapped"):
        spec_generate(model, RepeatDrafter(4, 48), torch.tensor([[1, 2]]), max_new_tokens=4)
