"""Bad input gets a clear ValueError / TypeError / NotImplementedError naming the problem."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash2 import DFlash2Config, DFlash2Drafter, ar_generate, spec_generate, spec_generate_batch
from tests.helpers import MASK, tiny_target

BASE = dict(hidden_size=32, vocab_size=48, num_target_layers=4)


@pytest.mark.parametrize("fields, message", [
    (dict(block_size=0), "block_size"),
    (dict(hidden_size=40, conv_group_size=16), "not divisible by conv_group_size"),
    (dict(target_layer_ids=(1, 4)), r"target_layer_ids \[4\] out of range"),
    (dict(target_layer_ids=(-1,)), "out of range"),
    (dict(target_layer_ids=(1, 1)), "duplicates"),
    (dict(mask_token_id=48), "mask_token_id 48 is out of range"),
    (dict(conv="three_tap"), "unknown conv .three_tap.: registered are"),
    (dict(selector="beam"), "unknown selector .beam.: registered are"),
    (dict(selector_top_k=49), "selector_top_k"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(context_window=3, block_size=8), "context_window"),
    (dict(num_layers=0), "num_layers"),
])
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        DFlash2Config(**{**BASE, **fields})


def test_unknown_config_field():
    with pytest.raises(ValueError, match="unknown DFlash2Config fields"):
        DFlash2Config.from_dict({**BASE, "blocksize": 4})


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3")
    return DFlash2Drafter.from_target(target, block_size=4, mask_token_id=MASK), target


PROMPT = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.01), ValueError, "top_p"),
    (dict(top_k=-3), ValueError, "top_k"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
    (dict(stop_token_ids=[48]), ValueError, "stop_token_ids"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "prompt is empty"),
    (dict(input_ids=torch.zeros(1, 250, dtype=torch.long), max_new_tokens=10), ValueError, "maximum positions"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), TypeError, "dtype torch.long"),
    (dict(input_ids=[[1, 2]]), TypeError, "LongTensor"),
    (dict(input_ids=torch.tensor([[1, 99]])), ValueError, "outside the target vocabulary"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long)), ValueError, "batch 1"),
])
def test_generate_rejects_bad_input(pair, kwargs, error, message):
    drafter, target = pair
    call = dict(input_ids=PROMPT, max_new_tokens=5) | kwargs
    ids = call.pop("input_ids")
    with pytest.raises(error, match=message):
        spec_generate(drafter, target, ids, **call)
    with pytest.raises(error, match=message):
        ar_generate(target, ids, **call)


def test_drafter_and_target_must_fit(pair):
    drafter, _ = pair
    other_vocab = tiny_target("qwen3", vocab=40)
    with pytest.raises(ValueError, match="vocab_size"):
        spec_generate(drafter, other_vocab, PROMPT, max_new_tokens=3)
    wide = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=48, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).double()
    with pytest.raises(ValueError, match="hidden_size"):
        spec_generate(drafter, wide, PROMPT, max_new_tokens=3)
    with pytest.raises(ValueError, match="must equal the target"):
        DFlash2Drafter.from_target(tiny_target("qwen3"), vocab_size=64)
    wider = DFlash2Drafter.from_target(tiny_target("qwen3"), hidden_size=64, mask_token_id=MASK)  # its own modules
    assert (wider.config.target_hidden_size, wider.config.own_embedding, wider.config.own_lm_head) == (32, True, True)
    with pytest.raises(ValueError, match="drafter target_hidden_size = 32, target hidden_size = 64"):
        spec_generate(wider, wide, PROMPT, max_new_tokens=3)


def test_target_must_be_a_causal_lm(pair):
    drafter, _ = pair
    with pytest.raises(TypeError, match="Hugging Face causal LM"):
        spec_generate(drafter, torch.nn.Linear(2, 2), PROMPT, max_new_tokens=3)


def test_swapped_drafter_and_target_are_named(pair):
    drafter, target = pair
    for generate in (spec_generate, spec_generate_batch):
        with pytest.raises(TypeError, match="swapped"):
            generate(target, drafter, PROMPT, max_new_tokens=3)


def test_recurrent_targets_without_rollback_are_refused_clearly():
    config = transformers.MambaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, state_size=4)
    target = transformers.MambaForCausalLM(config)
    with pytest.raises(NotImplementedError, match="mamba"):
        DFlash2Drafter.from_target(target)
    with pytest.raises(NotImplementedError, match="mamba"):
        ar_generate(target, PROMPT, max_new_tokens=2)


def test_hybrid_targets_on_too_old_transformers_are_refused_clearly(monkeypatch):
    """Releases before HYBRID_MIN_TRANSFORMERS fail inside Qwen3.5 or decode wrong tokens after a rollback
    (measured: 5.3.0, 5.5.4, 5.6.2): the adapter names the release needed instead; attention-only targets run."""
    import dflash2.targets.adapter
    from tests.helpers import HYBRID_ARCHITECTURES

    hybrid = tiny_target(HYBRID_ARCHITECTURES[0])
    monkeypatch.setattr(dflash2.targets.adapter, "transformers_version", lambda: (5, 6))
    with pytest.raises(NotImplementedError, match=r"transformers >= 5\.7"):
        ar_generate(hybrid, PROMPT, max_new_tokens=2)
    assert ar_generate(tiny_target("qwen3"), PROMPT, max_new_tokens=2).new_tokens.numel() == 2
    monkeypatch.setattr(dflash2.targets.adapter, "transformers_version", lambda: (5, 7))
    assert dflash2.targets.adapter.TargetAdapter(hybrid).hybrid


def test_transformers_version_parses_release_names(monkeypatch):
    import dflash2.targets.adapter

    for name, want in (("5.7.0", (5, 7)), ("5.24.0.dev0", (5, 24)), ("5.10rc1", (5, 10)), ("6.0.0", (6, 0))):
        monkeypatch.setattr(dflash2.targets.adapter.transformers, "__version__", name)
        assert dflash2.targets.adapter.transformers_version() == want
