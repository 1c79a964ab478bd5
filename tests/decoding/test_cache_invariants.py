"""After every round the target cache equals a fresh prefill of the committed tokens (but the anchor),
and the drafter's context cache equals recomputing it from all features seen so far."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from dflash2 import DFlash2Drafter, TargetAdapter, spec_generate
from tests.helpers import MASK, hf_greedy, needs_hybrid_transformers, oracle_drafter, tiny_target


class CheckingAdapter(TargetAdapter):
    """Keeps the ids the cache should hold; after each rollback, compares the cache with a fresh prefill."""

    atol = 1e-12

    def __init__(self, model, layer_ids):
        super().__init__(model, layer_ids)
        self.ids: list[int] = []
        self.checked = 0

    def forward(self, input_ids, cache, keep_logits=None):
        self.ids += input_ids[0].tolist()
        return super().forward(input_ids, cache, keep_logits)

    def rollback(self, cache, step, keep):
        super().rollback(cache, step, keep)
        length = step.start + keep
        self.ids = self.ids[:length]
        assert cache.get_seq_length() == length
        probe = torch.tensor([[7]])
        fresh = self.new_cache()
        with torch.no_grad():
            self.model(input_ids=torch.tensor([self.ids]), use_cache=True, **{self._cache_kw: fresh})
            ours = self.model(input_ids=probe, use_cache=True, **{self._cache_kw: copy.deepcopy(cache)}).logits
            theirs = self.model(input_ids=probe, use_cache=True, **{self._cache_kw: fresh}).logits
        torch.testing.assert_close(ours, theirs, rtol=0, atol=self.atol)
        self.checked += 1


class CheckingDrafter(DFlash2Drafter):
    """After each proposal, the context cache must equal a recomputation from all features."""

    def new_cache(self):
        self.features = []
        return super().new_cache()

    def propose(self, cache, anchor, new_features, target, temperature, rng):
        self.features.append(new_features)
        draft = super().propose(cache, anchor, new_features, target, temperature, rng)
        everything = torch.cat(self.features, dim=1)
        assert cache.length == everything.shape[1]
        recomputed = self.backbone.context_kv(everything, torch.arange(everything.shape[1]))
        window = self.config.context_window or everything.shape[1]
        for (k, v), ck, cv in zip(recomputed, cache.keys, cache.values):
            torch.testing.assert_close(ck, k[:, :, -window:], rtol=0, atol=1e-12)
            torch.testing.assert_close(cv, v[:, :, -window:], rtol=0, atol=1e-12)
        return draft


@pytest.mark.parametrize("arch", ["qwen3", "mistral_sliding", "gpt2"])
@pytest.mark.parametrize("window", [None, 8])
def test_target_and_drafter_caches_after_every_round(arch, window):
    target = tiny_target(arch)
    torch.manual_seed(0)
    drafter = CheckingDrafter(DFlash2Drafter.from_target(target, block_size=5, mask_token_id=MASK,
                                                         context_window=window).config).double()
    adapter = CheckingAdapter(target, drafter.target_layer_ids)
    prompt = [3, 1, 4, 1, 5, 9]
    result = spec_generate(drafter, adapter, torch.tensor([prompt]), max_new_tokens=25)
    assert result.sequences[0].tolist() == hf_greedy(target, prompt, 25)
    assert adapter.checked == result.num_rounds > 0
    assert adapter.ids == result.sequences[0].tolist()[:-1]


def test_target_cache_with_partial_acceptance():
    """Partial acceptance crops mid-block: the oracle with corruptions makes it happen every round."""
    target, prompt = tiny_target("qwen3"), [2, 7, 1, 8]
    reference = hf_greedy(target, prompt, 30)
    stub = oracle_drafter(8, reference, corrupt_every=4)
    adapter = CheckingAdapter(target, stub.target_layer_ids)
    result = spec_generate(stub, adapter, torch.tensor([prompt]), max_new_tokens=30)
    assert result.sequences[0].tolist() == reference
    assert 1 < max(result.acceptance_lengths) < 8 and adapter.checked == result.num_rounds


def test_target_cache_appends_in_place_and_survives_crops_and_row_changes():
    """The adapter's cache layers write each pass's entries into spare slots of one buffer (no copy of
    the whole cache per pass); crops, in-place moves, dropped rows and dropped slots keep every layer
    equal to a plain concatenating cache fed the same operations (float64)."""
    from transformers import DynamicCache

    from dflash2.targets.cache import GrowingLayer

    target = tiny_target("qwen3")
    adapter = TargetAdapter(target)
    ours, plain = adapter.new_cache(), DynamicCache()
    g = torch.Generator().manual_seed(0)
    ids = lambda n, rows=3: torch.randint(0, MASK, (rows, n), generator=g)  # noqa: E731

    def run(x):
        for cache in (ours, plain):
            adapter.forward(x, cache)

    def same():
        assert all(isinstance(layer, GrowingLayer) for layer in ours.layers)
        for a, b in zip(ours.layers, plain.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    run(ids(5))
    start = ours.layers[0].keys.data_ptr()
    run(ids(2))
    assert ours.layers[0].keys.data_ptr() == start  # appended into the same buffer
    same()
    for cache in (ours, plain):
        adapter.keep_block(cache, 5, torch.tensor([[1], [0], [1]]))  # each row keeps one of the two new slots
    run(ids(3))
    same()
    for cache in (ours, plain):
        adapter.select_rows(cache, torch.tensor([2, 0]))
        adapter.keep_slots(cache, torch.tensor([0, 2, 3, 5, 6, 7, 8]))
    run(ids(2, rows=2))  # fits the old buffer, which no longer holds these rows and slots
    same()
    run(ids(40, rows=2))  # past the buffer's capacity
    same()


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "gemma3", pytest.param("qwen3_5", marks=needs_hybrid_transformers)])
def test_prefill_keeps_only_the_last_logits(arch):
    """A prefill needs the last position's logits, not T × vocabulary (600 MB for 1000 tokens of a 151k
    vocabulary in float32): keep_logits=1 gives exactly that row, the same features and the same cache."""
    target = tiny_target(arch)
    adapter = TargetAdapter(target, (0, 1))
    ids = torch.tensor([[3, 9, 4, 1, 7, 2, 8]])
    caches = [adapter.new_cache(), adapter.new_cache()]
    full, last = adapter.forward(ids, caches[0]), adapter.forward(ids, caches[1], keep_logits=1)
    assert last.logits.shape == (1, 1, full.logits.shape[-1])
    assert torch.allclose(last.logits, full.logits[:, -1:], atol=1e-12, rtol=0)
    assert torch.equal(last.features, full.features)
    after = [adapter.forward(torch.tensor([[5]]), c).logits for c in caches]
    assert torch.allclose(after[0], after[1], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="keep_logits"):
        adapter.forward(ids, adapter.new_cache(), keep_logits=0)


def test_keep_logits_without_the_model_keyword_slices():
    """Models whose forward lacks `logits_to_keep` compute every row; the adapter still returns the last."""
    model = tiny_target("qwen3")
    ids = torch.tensor([[3, 9, 4, 1]])
    full = TargetAdapter(model).forward(ids, TargetAdapter(model).new_cache()).logits
    forward = model.forward
    if "cache" in inspect.signature(forward).parameters:  # the model's forward without logits_to_keep
        model.forward = lambda input_ids=None, cache=None, **kw: forward(input_ids=input_ids, cache=cache, **kw)
    else:  # (transformers releases whose cache keyword is past_key_values)
        model.forward = lambda input_ids=None, **kw: forward(input_ids=input_ids, **kw)
    adapter = TargetAdapter(model)
    assert torch.equal(adapter.forward(ids, adapter.new_cache(), keep_logits=2).logits, full[:, -2:])
    T = ids.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None]
    pos = torch.arange(T)[None]
    assert torch.allclose(adapter.forward_masked(ids, pos, pos, allowed, adapter.new_cache(), keep_logits=1).logits,
                          full[:, -1:], atol=1e-12, rtol=0)
