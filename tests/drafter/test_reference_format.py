"""The published DFlash / DFlash 2 checkpoint format: strict loading, bit-exact round trip, lossless use.

Reference directories are written here from the design doc's list of tensor names and shapes, not
through dflash2's own mapping, so the two are checked against each other.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2 import DFlash2Drafter, spec_generate
from tests.helpers import MASK, VOCAB, hf_greedy, random_reference_tensors, tiny_target

H, HEADS, KV, HD, INTER, LAYERS, TAPS, GROUP, RANK = 32, 4, 2, 8, 48, 2, 2, 16, 8


def reference_tensors(version: int, suffix: bool, n_features: int = 3) -> dict[str, torch.Tensor]:
    return random_reference_tensors(v2=version == 2, layers=LAYERS, hidden=H, heads=HEADS, kv_heads=KV, head_dim=HD,
                                    intermediate=INTER, n_features=n_features, vocab=VOCAB, taps=TAPS, group=GROUP,
                                    rank=RANK, seed=version * 10 + suffix, codebook_suffix=".weight" if suffix else "")


def reference_config(version: int) -> dict:
    dflash = {"mask_token_id": MASK, "target_layer_ids": [0, 2, 3], "block_size": 6}
    if version == 2:
        dflash |= {"conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK, "selector_top_k": 4}
    return {"architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "vocab_size": VOCAB, "torch_dtype": "float64",
            "block_size": 6, "num_target_layers": 4, "dflash_config": dflash}


def write_reference(path, version: int, suffix: bool = False, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(reference_config(version)))
    save_file(tensors if tensors is not None else reference_tensors(version, suffix), str(path / "model.safetensors"))
    return path


CASES = [(2, False), (2, True), (1, False)]


@pytest.mark.parametrize("version, suffix", CASES, ids=["v2", "v2-weight-suffix", "v1"])
def test_round_trip_is_bit_exact(tmp_path, version, suffix):
    """Tensors come back bit for bit (codebooks under their published bare names), and the config
    field for field, with the weights' `dtype` added (the engines read it)."""
    src = write_reference(tmp_path / "src", version, suffix)
    drafter = DFlash2Drafter.from_pretrained(src)
    assert drafter.config.conv == ("two_tap" if version == 2 else "none")
    assert drafter.config.selector == ("walk" if version == 2 else "argmax")
    drafter.save_pretrained(tmp_path / "back", format="reference")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    a = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in a.items()}
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back == reference_config(version) | {"dtype": "float64"}


@pytest.mark.parametrize("version, suffix", CASES, ids=["v2", "v2-weight-suffix", "v1"])
def test_loaded_reference_drafter_is_lossless(tmp_path, version, suffix):
    drafter = DFlash2Drafter.from_pretrained(write_reference(tmp_path / "src", version, suffix))
    target = tiny_target("qwen3")
    for prompt in ([3, 1, 4], [2, 7, 1, 8, 2, 8]):
        out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=20)
        assert out.sequences[0].tolist() == hf_greedy(target, prompt, 20)


def test_our_drafter_through_the_reference_format_and_back(tmp_path):
    torch.manual_seed(0)
    ours = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=5, selector_top_k=4, selector_rank=8,
                                      mask_token_id=MASK, input_embedding_scale=1.5, final_logit_softcapping=4.0,
                                      context_window=12)
    ours.save_pretrained(tmp_path / "ref", format="reference")
    again = DFlash2Drafter.from_pretrained(tmp_path / "ref")
    for field in ("hidden_size", "block_size", "target_layer_ids", "conv", "selector", "input_embedding_scale",
                  "final_logit_softcapping", "selector_top_k", "rope_parameters", "attention_layout"):
        assert getattr(again.config, field) == getattr(ours.config, field), field
    assert again.config.context_window is None  # a serving option (--speculative-draft-window-size), not exported
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing"),
    (lambda t: t.__setitem__("layers.0.mlp.bias", torch.zeros(H, dtype=torch.float64)), "unused"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(VOCAB, H + 1, dtype=torch.float64)), "wrong shapes"),
    (lambda t: t.__setitem__("fc.weight", torch.zeros(H, 2 * H, dtype=torch.float64)), "wrong shapes"),
    (lambda t: t.pop("candidate_selector.successor_codebook"), "missing"),
])
def test_reference_loading_is_strict(tmp_path, edit, message):
    tensors = reference_tensors(2, False)
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        DFlash2Drafter.from_pretrained(write_reference(tmp_path / "bad", 2, tensors=tensors))


def test_no_reference_form_for_mixed_ablations(tmp_path):
    d = DFlash2Drafter.from_target(tiny_target("qwen3"), conv="two_tap", selector="argmax", mask_token_id=MASK)
    with pytest.raises(ValueError, match="no reference form"):
        d.save_pretrained(tmp_path, format="reference")
    with pytest.raises(ValueError, match="format"):
        d.save_pretrained(tmp_path, format="sglang")


def test_a_hub_id_loads_from_the_cache(tmp_path, monkeypatch):
    """A drafter named by its hub id is read from the Hugging Face cache (here offline)."""
    import huggingface_hub

    from dflash2 import DFlash2Drafter
    from tests.helpers import MASK, tiny_target

    drafter = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=4, mask_token_id=MASK)
    snapshot = tmp_path / "models--someone--tiny-dflash" / "snapshots" / ("a" * 40)
    drafter.save_pretrained(snapshot, format="reference")
    (tmp_path / "models--someone--tiny-dflash" / "refs").mkdir()
    (tmp_path / "models--someone--tiny-dflash" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = DFlash2Drafter.from_pretrained("someone/tiny-dflash")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    with pytest.raises(FileNotFoundError, match=r"someone/not-cached: not a local directory, and offline "
                                                r"\(HF_HUB_OFFLINE is set\): it is not in the local Hugging Face cache"):
        DFlash2Drafter.from_pretrained("someone/not-cached")
