"""Draft vocabularies (FR-Spec): the drafter's LM head over a subset of token ids.

The head's logits over the subset must be the full logits' columns, candidates must be token ids of
the subset (not positions in it), the subset must survive save/load and with_config, bad subsets
must be refused, and decoding must stay lossless: greedy equal to the target's (paths, trees,
batches); the exact sampled distribution is checked in test_exact_distribution.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dflash2 import DFlash2Drafter, TargetAdapter, spec_generate, spec_generate_batch
from dflash2.drafter.draft_vocab import count_tokens, coverage, load_counts, most_frequent, save_counts
from tests.helpers import VOCAB, hf_greedy, tiny_target


def drafter_for(target, **fields) -> DFlash2Drafter:
    torch.manual_seed(0)
    return DFlash2Drafter.from_target(target, block_size=6, mask_token_id=VOCAB - 1, selector_top_k=4,
                                      selector_rank=8, **fields).eval()


def test_most_frequent_ranks_by_count_then_id():
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert most_frequent(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the lower id of the two 5s
    assert most_frequent(counts, 6).tolist() == list(range(6))
    assert coverage(counts, most_frequent(counts, 2)) == pytest.approx(18 / 29)
    for bad in (0, 7):
        with pytest.raises(ValueError, match="n must be"):
            most_frequent(counts, bad)


def test_count_tokens_and_the_counts_file(tmp_path):
    class Tok:  # a character-level tokenizer: "a" → 0, "b" → 1, ...
        def __call__(self, text, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [ord(c) - ord("a") for c in text]})

    counts = count_tokens(Tok(), ["abca", "cc"], vocab_size=4)
    assert counts.tolist() == [2, 1, 3, 0]
    with pytest.raises(ValueError, match="outside vocab_size"):
        count_tokens(Tok(), ["e"], vocab_size=4)
    save_counts(counts, tmp_path / "c.safetensors")
    assert torch.equal(load_counts(tmp_path / "c.safetensors"), counts)
    save_counts(-counts, tmp_path / "neg.safetensors")
    with pytest.raises(ValueError, match="token counts"):
        load_counts(tmp_path / "neg.safetensors")


def test_embedded_counts_cover_the_embedded_vocabulary():
    from dflash2.embedded import available, token_counts

    if not available():
        pytest.skip("the embedded pair is not shipped")
    counts = token_counts()
    assert counts.numel() == 4096 and int(counts.sum()) > 1_000_000
    assert 0.85 < coverage(counts, most_frequent(counts, 2048)) < 1.0


def test_subset_logits_are_the_full_logits_columns_and_ids_are_token_ids():
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target)
    ids = torch.tensor([3, 7, 8, 20, 31, 40, 41, 46])
    drafter = drafter_for(target).with_draft_vocab(ids[torch.randperm(len(ids))])  # any order: kept sorted
    assert torch.equal(drafter.draft_vocab, ids) and drafter.config.draft_vocab_size == len(ids)
    hidden = torch.randn(5, adapter.hidden_size)
    full = adapter.lm_logits(hidden)
    assert torch.allclose(adapter.lm_logits(hidden, ids), full[:, ids], atol=1e-6)
    cands = drafter.draft_candidates(hidden, adapter)
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    want_scores, want_ids = masked.topk(4, dim=-1)
    assert torch.equal(cands.ids, want_ids)  # token ids, not positions in the subset
    assert torch.allclose(cands.scores, want_scores, atol=1e-6)
    # a bfloat16 drafter reads a bfloat16 copy of those rows, redone when the head changes
    low = adapter.lm_logits(hidden.bfloat16(), ids)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), full[:, ids], atol=0.1, rtol=0.02)
    head = copy.deepcopy(target)
    changed = TargetAdapter(head)
    changed.lm_logits(hidden.bfloat16(), ids)
    with torch.no_grad():
        head.get_output_embeddings().weight.mul_(2.0)
    assert torch.allclose(changed.lm_logits(hidden.bfloat16(), ids).float(), 2 * full[:, ids], atol=0.2, rtol=0.02)


def test_the_draft_vocabulary_survives_save_load_and_with_config(tmp_path):
    target = tiny_target("qwen3")
    drafter = drafter_for(target).with_draft_vocab(list(range(10, 30)))
    drafter.save_pretrained(tmp_path / "d")
    loaded = DFlash2Drafter.from_pretrained(tmp_path / "d")
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab) and loaded.config.draft_vocab_size == 20
    assert torch.equal(loaded.with_config(block_size=4).draft_vocab, drafter.draft_vocab)
    assert loaded.to(torch.bfloat16).draft_vocab.dtype == torch.long
    full = loaded.with_config(draft_vocab_size=None)
    assert full.draft_vocab is None and "draft_vocab" not in full.state_dict()
    with pytest.raises(ValueError, match="with_draft_vocab"):
        full.with_config(draft_vocab_size=20)
    with pytest.raises(ValueError, match="pass target="):
        drafter.save_pretrained(tmp_path / "r", format="reference")


@pytest.mark.parametrize("conv, selector", [("two_tap", "walk"), ("none", "argmax")])
def test_the_reference_format_carries_the_draft_vocabulary_as_d2t(tmp_path, conv, selector):
    """Written as EAGLE-3 and llama.cpp's converters read it: the head's rows of the draft tokens, d2t
    offsets, draft_vocab_size; read back, it drafts what the drafter drafted, and writes the same file."""
    from safetensors.torch import load_file

    target = tiny_target("qwen3")
    ids = torch.tensor([0, 3, 4, 9, 11, 12, 14, 15, 17, 20, 21, 25, 28, 30, 31, 33, 36, 40, 44, 46])
    drafter = drafter_for(target, conv=conv, selector=selector).with_draft_vocab(ids)
    drafter.save_pretrained(tmp_path / "r", format="reference", target=target)
    meta = __import__("json").loads((tmp_path / "r" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "r" / "model.safetensors"))
    assert meta["draft_vocab_size"] == 20 and torch.equal(tensors["d2t"] + torch.arange(20), ids)
    assert torch.equal(tensors["lm_head.weight"], target.get_output_embeddings().weight.detach()[ids])
    loaded = DFlash2Drafter.from_pretrained(tmp_path / "r")
    assert torch.equal(loaded.draft_vocab, ids) and loaded.lm_head is not None
    prompt = torch.tensor([[5, 9, 2, 7, 11]])
    a, b = (spec_generate(d, target, prompt, max_new_tokens=24) for d in (drafter, loaded))
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths
    loaded.save_pretrained(tmp_path / "again", format="reference")  # its own head now: no target needed
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    del tensors["d2t"]
    from safetensors.torch import save_file
    save_file(tensors, str(tmp_path / "r" / "model.safetensors"))
    with pytest.raises(ValueError, match="needs the tensors d2t"):
        DFlash2Drafter.from_pretrained(tmp_path / "r")


@pytest.mark.parametrize("ids, match", [
    ([1, 2, 3], "at least selector_top_k"),
    ([1, 2, 3, 3, 4], "distinct"),
    ([1, 2, 3, VOCAB], "must lie in"),
    ([-1, 2, 3, 4], "must lie in"),
])
def test_bad_draft_vocabularies_are_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        drafter_for(tiny_target("qwen3")).with_draft_vocab(ids)


def test_a_bad_stored_draft_vocabulary_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    drafter = drafter_for(tiny_target("qwen3")).with_draft_vocab(list(range(8)))
    drafter.save_pretrained(tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state["draft_vocab"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="distinct"):
        DFlash2Drafter.from_pretrained(tmp_path / "d")


def test_config_bounds_the_draft_vocabulary_size():
    target = tiny_target("qwen3")
    for bad in (3, VOCAB + 1, True):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            drafter_for(target, draft_vocab_size=bad)


@pytest.mark.parametrize("verify", ["path", "tree"])
def test_greedy_output_is_the_targets_with_a_draft_vocabulary(verify):
    """Half the vocabulary, the other half never drafted: every output is still the target's."""
    target = tiny_target("qwen3")
    prompt = [5, 9, 13, 2]
    want = hf_greedy(target, prompt, 24)[len(prompt):]
    reference = torch.tensor(want)
    ids = torch.unique(torch.cat([reference[: len(reference) // 2], torch.arange(0, VOCAB, 2)]))
    drafter = drafter_for(target, conv="two_tap", selector="walk").with_draft_vocab(ids)
    seen = []  # every candidate any selector's lattice (walk, tree) reads, from every path below
    real = drafter.candidate_selector.lattice
    drafter.candidate_selector.lattice = lambda cands, *a, **k: seen.append(cands) or real(cands, *a, **k)
    drafted = []  # every token drafted: paths and trees, at batch 1 and in batches
    for name in ("propose", "propose_tree", "propose_batch", "propose_tree_batch"):
        method = getattr(drafter, name)
        setattr(drafter, name, lambda *a, method=method, **k: (lambda out: drafted.append(out) or out)(method(*a, **k)))
    out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=24, verify=verify, tree_nodes=6)
    assert out.new_tokens.tolist() == want
    batch = spec_generate_batch(drafter, target, torch.tensor([prompt, prompt]), torch.ones(2, 4, dtype=torch.long),
                                max_new_tokens=24, verify=verify, tree_nodes=6)
    assert [r.new_tokens.tolist() for r in batch] == [want, want]
    assert seen and all(torch.isin(c.ids, ids).all() for c in seen)
    tokens = [d.tokens for out in drafted for d in (out if isinstance(out, list) else [out])]
    assert len(tokens) > 2 and torch.isin(torch.cat(tokens), ids).all()
    assert not set(want) <= set(ids.tolist())  # the target does say tokens the drafter cannot
