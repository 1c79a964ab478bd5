"""Fidelity to the published drafters: every checkpoint layout drafts exactly what the published
semantics compute (tests/published_reference.py, an independent forward), in every place the drafter
runs (one sequence across rounds, a ContextBatch, the training forward), and exports carry the layout.

Reference directories are random checkpoints written by their published tensor names; the drafter
reads them through `from_pretrained`, so the config reader is under test too. Float64: hidden states
must agree to 1e-10 and every draft token must be the same. Mutants of the layout mask (a window per
block instead of per query; causality ignored) must fail the same comparison.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash2.drafter.backbone as backbone
from dflash2 import DFlash2Drafter, TargetAdapter, spec_generate, spec_generate_batch
from dflash2.drafter.reference_format import config_from_reference, reference_from_config
from dflash2.train.forward import masked_block_forward
from tests import published_reference as ref
from tests.helpers import MASK, VOCAB, hf_greedy, random_reference_tensors, tiny_target

H, HEADS, KV, HD, INTER, B, GROUP, TAPS, RANK, TOP_K = 32, 4, 2, 12, 40, 6, 16, 2, 8, 4  # HD != H / HEADS
LAYER_IDS = [0, 2, 3]
S, F = "sliding_attention", "full_attention"
ROUNDS = (9, 4, 3, 5)  # context positions added per round: 9, 13, 16, 21 in all

LAYOUTS = {
    "full-bidirectional": {},
    "full-causal": {"is_causal": True},
    "sliding-W7-noncausal": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 7, "is_causal": False},
    "sliding-W7-causal-unset": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 7},
    "sliding-W7-causal": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 7, "is_causal": True},
    "sliding-W3-noncausal": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 3, "is_causal": False},
    "sliding-W3-causal-unset": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 3},
    "sliding-W40-noncausal": {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 40,
                              "is_causal": False},
    "mixed-W5-noncausal": {"num_hidden_layers": 3, "layer_types": [S, F, S], "use_sliding_window": True,
                           "sliding_window": 5, "is_causal": False},
    "mixed-W5-causal-unset": {"num_hidden_layers": 3, "layer_types": [F, S, S], "use_sliding_window": True,
                              "sliding_window": 5},
    "sliding-without-use_sliding_window": {"layer_types": [S, S], "sliding_window": 5},  # Qwen3Config drops W
    "max_window_layers": {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4,
                          "max_window_layers": 1, "is_causal": False},  # no layer_types: layers 1, 2 slide
    # vLLM's fields (MiMo-V2.5-Pro DFlash: use_swa, non-causal): every layer slides, bidirectional
    "use_swa-W5": {"dflash_config": {"use_swa": True, "swa_window_size": 5}},
    "use_swa-top-level-window": {"use_sliding_window": True, "sliding_window": 6, "dflash_config": {"use_swa": True}},
    "use_swa-over-full-types": {"layer_types": [F, F], "use_sliding_window": True, "sliding_window": 4,
                                "dflash_config": {"use_swa": True}},
    "use_swa-mixed-types": {"num_hidden_layers": 3, "layer_types": [S, F, S],  # the types decide, S causal
                            "dflash_config": {"use_swa": True, "swa_window_size": 5}},
    "use_swa-causal": {"dflash_config": {"use_swa": True, "swa_window_size": 4, "causal": True}},
    "dflash-causal": {"dflash_config": {"causal": True}},
    "dflash-causal-under-is_causal": {"is_causal": False, "dflash_config": {"causal": True}},  # is_causal wins
}
EXTRAS = {
    "options": {"dflash_config": {"output_multiplier": 0.7, "final_logit_softcapping": 2.5,
                                  "input_embedding_scale": 1.7}},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 8}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
    "partial-rotary": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5}},
    "top-level-options": {"output_multiplier": 1.3, "input_embedding_scale": 0.8},  # read after dflash_config
    # vLLM's attention fields
    "value-scale": {"dflash_config": {"attention_value_scale": 0.45}},
    "sink-bias": {"dflash_config": {"attention_sink_bias": True}},
    "sink-bias-top-level": {"add_swa_attention_sink_bias": True},
    "interleaved-rope": {"is_neox_style": False},
    "interleaved-partial-rope": {"is_neox_style": False, "rope_parameters": {"rope_type": "default",
                                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "mimo-like": {"is_neox_style": False, "dflash_config": {"use_swa": True, "swa_window_size": 5,
                                                            "attention_sink_bias": True, "attention_value_scale": 2.0}},
}


def reference_config(version: int, overrides: dict) -> dict:
    cfg = {"architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
           "vocab_size": VOCAB, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "num_target_layers": 4, "dtype": "float64",
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "block_size": B}}
    if version == 2:
        cfg["dflash_config"] |= {"conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK,
                                 "selector_top_k": TOP_K}
    overrides = dict(overrides)
    cfg["dflash_config"] |= overrides.pop("dflash_config", {})
    return cfg | overrides


def reference_tensors(cfg: dict, seed: int = 0, own_modules: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors for `cfg` (its width; fc as wide as its target_hidden_size), with the drafter's own
    embed_tokens and lm_head when `own_modules`."""
    t = random_reference_tensors(v2="DFlash2DraftModel" in cfg["architectures"], layers=cfg["num_hidden_layers"],
                                 hidden=cfg["hidden_size"], heads=HEADS, kv_heads=KV, head_dim=HD, intermediate=INTER,
                                 n_features=len(LAYER_IDS), vocab=VOCAB, taps=TAPS, group=GROUP, rank=RANK,
                                 seed=seed, scale=0.3, base_offset=0.5, codebook_scale=3.0,
                                 target_hidden=cfg.get("target_hidden_size"), own_modules=own_modules)
    if ref.resolve(cfg)["sinks"]:  # vLLM's per-head sink logits, one vector per layer (large: they must matter)
        g = torch.Generator().manual_seed(seed + 100)
        for i in range(cfg["num_hidden_layers"]):
            t[f"layers.{i}.self_attn.attention_sink_bias"] = 2.0 * torch.randn(HEADS, generator=g, dtype=torch.float64)
    return t


def write(path, cfg: dict, tensors: dict) -> DFlash2Drafter:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return DFlash2Drafter.from_pretrained(path).eval()


def features(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, len(LAYER_IDS) * H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def compare_rounds(drafter: DFlash2Drafter, cfg: dict, tensors: dict, seed: int = 0) -> tuple[float, int, int]:
    """Decode-like rounds on one ContextCache against the reference recomputed from scratch each round
    → (largest hidden-state difference, draft tokens that differ, draft tokens compared). The reference
    embeds and drafts with the checkpoint's own embed_tokens / lm_head where it ships them (as vLLM
    keeps them), else with the target's."""
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    embedding = tensors.get("embed_tokens.weight", target.get_input_embeddings().weight.detach())
    head = tensors.get("lm_head.weight", target.get_output_embeddings().weight.detach())
    everything = features(sum(ROUNDS), seed)
    anchors = torch.randint(0, MASK, (len(ROUNDS),), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    cache, worst, differ, total, start = drafter.new_cache(), 0.0, 0, 0, 0
    keep = drafter.config.context_keep
    for n, anchor in zip(ROUNDS, anchors):
        with torch.no_grad():
            draft = drafter.propose(cache, anchor, everything[None, start:start + n], adapter, 0.0, None)
            ours = drafter.block_hidden(cache, anchor, adapter)[0]
        start += n
        assert cache.keys[0].shape[2] == (start if keep is None else min(start, keep))  # what the cache keeps
        want = ref.block_hidden(cfg, tensors, embedding, everything[:start], anchor)
        worst = max(worst, float((ours - want).abs().max()))
        expected = ref.drafts(cfg, tensors, want, head, anchor)
        differ += sum(a != b for a, b in zip(draft.tokens.tolist(), expected))
        total += len(expected)
    return worst, differ, total


@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_drafts_the_published_semantics(tmp_path, layout, version):
    cfg = reference_config(version, LAYOUTS[layout])
    tensors = reference_tensors(cfg)
    worst, differ, total = compare_rounds(write(tmp_path, cfg, tensors), cfg, tensors)
    assert worst < 1e-10 and differ == 0, f"{layout}: hidden states off by {worst:.2e}, {differ}/{total} drafts differ"


@pytest.mark.parametrize("extra", EXTRAS)
def test_options_and_rope_scaling_draft_the_published_semantics(tmp_path, extra):
    cfg = reference_config(2, LAYOUTS["mixed-W5-noncausal"] | EXTRAS[extra])
    tensors = reference_tensors(cfg, seed=3)
    worst, differ, total = compare_rounds(write(tmp_path, cfg, tensors), cfg, tensors, seed=3)
    assert worst < 1e-10 and differ == 0, f"{extra}: hidden states off by {worst:.2e}, {differ}/{total} drafts differ"


def _per_block_window(layout_mask):
    def mutant(q, k, causal, window):  # every query of the block measured from the block's first position
        start = q[..., :1].expand_as(q)
        return backbone._and(layout_mask(start, k, False, window), layout_mask(q, k, causal, None))
    return mutant


MUTANTS = {
    "window-per-block": (_per_block_window, ["sliding-W7-noncausal", "sliding-W3-causal-unset", "mixed-W5-noncausal"]),
    "causality-ignored": (lambda m: lambda q, k, causal, window: m(q, k, False, window),
                          ["full-causal", "sliding-W7-causal-unset", "mixed-W5-causal-unset"]),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_parity_check_fails_on_layout_mutants(tmp_path, monkeypatch, mutant):
    make, layouts = MUTANTS[mutant]
    monkeypatch.setattr(backbone, "layout_mask", make(backbone.layout_mask))
    for layout in layouts:
        cfg = reference_config(2, LAYOUTS[layout])
        tensors = reference_tensors(cfg)
        worst, differ, _ = compare_rounds(write(tmp_path / layout, cfg, tensors), cfg, tensors)
        assert worst > 1e-3, f"the mutant {mutant} passes the parity check on {layout}"


def _without(cfg: dict, name: str) -> dict:
    """cfg read by a reader that does not know dflash_config.`name`."""
    out = json.loads(json.dumps(cfg))
    out["dflash_config"].pop(name)
    return out


def _each_attention(drafter, **changes):
    for layer in drafter.backbone.layers:
        for name, value in changes.items():
            setattr(layer.self_attn, name, value)
    return drafter


# a reader or a layer that ignores one of vLLM's fields must fail the parity check on a config that sets it
FIELD_MUTANTS = {
    "use_swa ignored": ("use_swa-W5", lambda cfg, path, t: write(path, _without(cfg, "use_swa"), t)),
    "swa_window_size ignored": ({"use_sliding_window": True, "sliding_window": 9,
                                 "dflash_config": {"use_swa": True, "swa_window_size": 3}},
                                lambda cfg, path, t: write(path, _without(cfg, "swa_window_size"), t)),
    "dflash causal ignored": ("dflash-causal", lambda cfg, path, t: write(path, _without(cfg, "causal"), t)),
    "value scale ignored": ("value-scale", lambda cfg, path, t: _each_attention(write(path, cfg, t), value_scale=None)),
    "sinks ignored": ("sink-bias", lambda cfg, path, t: _each_attention(write(path, cfg, t), attention_sink_bias=None)),
    "rotate-half for is_neox_style false": ("interleaved-rope",
                                            lambda cfg, path, t: _each_attention(write(path, cfg, t), interleaved=False)),
}


@pytest.mark.parametrize("mutant", FIELD_MUTANTS)
def test_the_parity_check_fails_when_a_published_field_is_ignored(tmp_path, mutant):
    name, make = FIELD_MUTANTS[mutant]
    fields = LAYOUTS.get(name, EXTRAS.get(name)) if isinstance(name, str) else name
    cfg = reference_config(2, fields)
    tensors = reference_tensors(cfg)
    assert compare_rounds(write(tmp_path / "right", cfg, tensors), cfg, tensors)[0] < 1e-10
    worst, _, _ = compare_rounds(make(cfg, tmp_path / "mutant", tensors), cfg, tensors)
    assert worst > 1e-3, f"{mutant}: the parity check passes (off by {worst:.1e})"


@pytest.mark.parametrize("extra", ["value-scale", "sink-bias", "interleaved-rope", "mimo-like"])
def test_vllms_attention_fields_hold_in_batches_in_training_and_stay_lossless(tmp_path, extra):
    cfg = reference_config(2, LAYOUTS["mixed-W5-noncausal"] | EXTRAS[extra] if extra != "mimo-like" else EXTRAS[extra])
    tensors = reference_tensors(cfg, seed=4)
    drafter = write(tmp_path, cfg, tensors)
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    embedding = target.get_input_embeddings().weight.detach()
    context, everything, lengths = drafter.new_context_batch(), [features(14, s) for s in range(2)], [0, 0]
    context.add_rows(2)
    for step in ([9, 4], [3, 6]):
        news = [everything[r][None, lengths[r]:lengths[r] + n] for r, n in enumerate(step)]
        lengths = [a + n for a, n in zip(lengths, step)]
        with torch.no_grad():
            drafter.propose_batch(context, [5, 17], news, adapter, 0.0, None)
            hidden = drafter.draft_round_batch(context, [5, 17], None, adapter, B - 1).hidden
        for r, anchor in enumerate([5, 17]):
            want = ref.block_hidden(cfg, tensors, embedding, everything[r][:lengths[r]], anchor)
            torch.testing.assert_close(hidden[r], want[1:], rtol=0, atol=1e-10)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(5))
    feats = features(20, 6)[None]
    anchors = torch.tensor([[1, 7, 12]])
    with torch.no_grad():
        out = masked_block_forward(drafter, adapter, ids, feats, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        want = ref.block_hidden(cfg, tensors, embedding, feats[0, :a], int(ids[0, a]))
        torch.testing.assert_close(out.hidden[0, j], want[1:], rtol=0, atol=1e-10)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for verify in ("path", "tree"):
        got = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=16, verify=verify)
        assert got.sequences[0].tolist() == hf_greedy(target, prompt, 16)


MIMO_LIKE = {  # the fields vLLM's docstring names for MiMo-V2.5-Pro DFlash, on a small drafter
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "vocab_size": 1000, "num_target_layers": 8, "is_neox_style": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "bfloat16",
    "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 4, 6], "block_size": 8, "use_swa": True,
                      "swa_window_size": 128, "attention_sink_bias": True, "attention_value_scale": 0.5},
}


def test_vllms_fields_are_read_and_written_back():
    config = config_from_reference(MIMO_LIKE)
    assert config.attention_layout == ((False, 128),) * 2
    assert config.attention_sink_bias and config.attention_value_scale == 0.5 and config.rope_interleaved
    out = reference_from_config(config, torch.bfloat16)
    assert {k: v for k, v in out.items() if k not in ("layer_types", "use_sliding_window", "sliding_window",
                                                      "is_causal")} == MIMO_LIKE  # every field as it was
    assert out["layer_types"] == [S, S] and out["is_causal"] is False and out["sliding_window"] == 128
    again = config_from_reference(out)
    assert (again.attention_layout, again.attention_sink_bias, again.attention_value_scale, again.rope_interleaved) == \
        (config.attention_layout, True, 0.5, True)
    top = json.loads(json.dumps(MIMO_LIKE))
    top["dflash_config"].pop("attention_sink_bias")
    top["add_swa_attention_sink_bias"] = True  # the top-level spelling is read, and written back where it was
    assert reference_from_config(config_from_reference(top), torch.bfloat16)["add_swa_attention_sink_bias"] is True
    without = {**MIMO_LIKE["dflash_config"]}
    without.pop("swa_window_size")
    for top in ({}, {"sliding_window": 64}):  # no window, or one Qwen3Config drops (no use_sliding_window)
        with pytest.raises(ValueError, match="use_swa needs a window"):
            config_from_reference(MIMO_LIKE | top | {"dflash_config": without})


def test_a_drafter_of_ours_with_vllms_fields_exports_them(tmp_path):
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=B, mask_token_id=MASK, selector_top_k=TOP_K,
                                   selector_rank=RANK, attention_sink_bias=True, attention_value_scale=0.7,
                                   rope_interleaved=True).double()
    assert d.backbone.layers[0].self_attn.attention_sink_bias.shape == (d.config.num_attention_heads,)
    d.save_pretrained(tmp_path, format="reference")
    out = json.loads((tmp_path / "config.json").read_text())
    assert out["is_neox_style"] is False and out["dflash_config"]["attention_sink_bias"] is True
    assert out["dflash_config"]["attention_value_scale"] == 0.7
    assert "layers.0.self_attn.attention_sink_bias" in load_file(str(tmp_path / "model.safetensors"))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    worst, differ, _ = compare_rounds(DFlash2Drafter.from_pretrained(tmp_path), out, tensors)
    assert worst < 1e-10 and differ == 0


@pytest.mark.parametrize("layout", ["full-causal", "sliding-W3-noncausal", "sliding-W7-causal-unset",
                                    "mixed-W5-noncausal", "max_window_layers"])
def test_batched_drafting_follows_the_published_semantics(tmp_path, layout):
    """Rows of different context lengths drafted in one pass over a ContextBatch (windows masked,
    not dropped) give the reference's hidden states and drafts, row by row."""
    cfg = reference_config(2, LAYOUTS[layout])
    tensors = reference_tensors(cfg)
    drafter = write(tmp_path, cfg, tensors)
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    context, everything, lengths = drafter.new_context_batch(), [features(20, s) for s in range(3)], [0, 0, 0]
    context.add_rows(3)
    for step in ([11, 3, 16], [2, 5, 1], [4, 1, 3]):
        news = [everything[r][None, lengths[r]:lengths[r] + n] for r, n in enumerate(step)]
        lengths = [a + n for a, n in zip(lengths, step)]
        anchors = [5, 17, 30]
        with torch.no_grad():
            drafts = drafter.propose_batch(context, anchors, news, adapter, 0.0, None)
            hidden = drafter.draft_round_batch(context, anchors, None, adapter, B - 1).hidden
        for r, anchor in enumerate(anchors):
            embedding = target.get_input_embeddings().weight.detach()
            want = ref.block_hidden(cfg, tensors, embedding, everything[r][:lengths[r]], anchor)
            torch.testing.assert_close(hidden[r], want[1:], rtol=0, atol=1e-10)
            assert drafts[r].tokens.tolist() == ref.drafts(cfg, tensors, want, target.get_output_embeddings().weight.detach(),
                                                           anchor)


@pytest.mark.parametrize("layout", ["full-causal", "sliding-W3-noncausal", "sliding-W7-causal-unset",
                                    "mixed-W5-causal-unset"])
def test_training_forward_follows_the_published_semantics(tmp_path, layout):
    """All blocks of a sequence in one masked pass: each block's hidden states are the reference's for
    the context before its anchor, with windows per query and causality inside the block."""
    cfg = reference_config(2, LAYOUTS[layout] | EXTRAS["options"])
    tensors = reference_tensors(cfg)
    drafter = write(tmp_path, cfg, tensors)
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    T = 24
    ids = torch.randint(0, MASK, (1, T), generator=torch.Generator().manual_seed(5))
    feats = features(T, 6)[None]
    anchors = torch.tensor([[1, 8, 10, 18]])  # overlapping blocks; the first sees one context position
    with torch.no_grad():
        out = masked_block_forward(drafter, adapter, ids, feats, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        want = ref.block_hidden(cfg, tensors, target.get_input_embeddings().weight.detach(), feats[0, :a], int(ids[0, a]))
        torch.testing.assert_close(out.hidden[0, j], want[1:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("layout", ["full-causal", "sliding-W3-causal-unset", "mixed-W5-noncausal"])
def test_causal_and_sliding_drafters_are_lossless(tmp_path, layout):
    cfg = reference_config(2, LAYOUTS[layout])
    drafter = write(tmp_path, cfg, reference_tensors(cfg))
    target = tiny_target("qwen3")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    for prompt in prompts:
        want = hf_greedy(target, prompt, 24)
        for verify in ("path", "tree"):
            out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=24, verify=verify)
            assert out.sequences[0].tolist() == want, verify
    ids = torch.tensor([[0] * 4 + prompts[1], prompts[0]])
    rows = spec_generate_batch(drafter, target, ids, (ids != 0) | (torch.arange(8) >= 4), max_new_tokens=24)
    assert [r.sequences[0].tolist() for r in rows] == [hf_greedy(target, p, 24) for p in prompts[::-1]]


# -- exports --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_then_load_drafts_identically_and_states_the_layout(tmp_path, layout):
    cfg = reference_config(2, LAYOUTS[layout])
    tensors = reference_tensors(cfg)
    drafter = write(tmp_path / "src", cfg, tensors)
    drafter.save_pretrained(tmp_path / "out", format="reference")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    again = DFlash2Drafter.from_pretrained(tmp_path / "out")
    assert again.config.attention_layout == drafter.config.attention_layout
    layout_fields = drafter.config.attention_layout
    if any(window is not None for _, window in layout_fields):
        assert out["use_sliding_window"] is True and out["sliding_window"] == drafter.config.sliding_window
        assert out["layer_types"] == [drafter.config.layer_type(i) for i in range(drafter.config.num_layers)]
    if any(drafter.config.layer_type(i) == S for i in range(drafter.config.num_layers)):
        assert "layer_types" in out and ("is_causal" in out or len({c for c, _ in layout_fields}) > 1)
    assert out["dtype"] == "float64" and "rope_parameters" in out
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook" in written and not any(k.endswith("codebook.weight") for k in written)
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)
    worst, differ, _ = compare_rounds(again, cfg, tensors)
    assert worst < 1e-10 and differ == 0


def test_codebooks_with_a_weight_suffix_load_and_are_written_bare(tmp_path):
    cfg = reference_config(2, LAYOUTS["sliding-W7-noncausal"])
    tensors = reference_tensors(cfg)
    suffixed = {k + (".weight" if k.endswith("codebook") else ""): v for k, v in tensors.items()}
    drafter = write(tmp_path / "src", cfg, suffixed)
    assert compare_rounds(drafter, cfg, tensors)[1] == 0
    drafter.save_pretrained(tmp_path / "out", format="reference")
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(tensors)
    both = suffixed | {"candidate_selector.successor_codebook": tensors["candidate_selector.successor_codebook"].clone()}
    with pytest.raises(ValueError, match="twice"):
        write(tmp_path / "both", cfg, both)


def test_from_target_layout_fields_are_exported_for_the_engines(tmp_path):
    target = tiny_target("qwen3")
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(target, block_size=B, mask_token_id=MASK, num_layers=2, selector_top_k=TOP_K,
                                   selector_rank=RANK, layer_types=(S, S), sliding_window=9, context_window=12)
    assert DFlash2Drafter.from_target(target, mask_token_id=MASK).config.attention_layout == ((False, None),)
    d.save_pretrained(tmp_path, format="reference")
    out = json.loads((tmp_path / "config.json").read_text())
    assert {k: out[k] for k in ("layer_types", "use_sliding_window", "sliding_window", "is_causal", "dtype")} == \
        {"layer_types": [S, S], "use_sliding_window": True, "sliding_window": 9, "is_causal": True, "dtype": "float64"}
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and "rope_theta" not in out
    again = DFlash2Drafter.from_pretrained(tmp_path)
    assert again.config.context_window is None  # a run-time option, not part of the published format
    assert again.config.attention_layout == d.config.attention_layout == ((True, 9), (True, 9))


# -- the released DFlash 2 layout -----------------------------------------------------------------
PUBLISHED = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 200000, "eos_token_id": 200001, "pad_token_id": 200018, "is_causal": False, "dtype": "bfloat16",
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 6656, "initializer_range": 0.02,
    "intermediate_size": 19968, "layer_types": [S] * 5, "max_position_embeddings": 131072, "max_window_layers": 5,
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048, "use_sliding_window": True, "tie_word_embeddings": False,
    "transformers_version": "5.15.0", "use_cache": False, "vocab_size": 202048,
    "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                      "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
                      "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]},
}


def test_the_published_config_reads_and_writes_back_field_for_field():
    config = config_from_reference(PUBLISHED)
    assert config.attention_layout == ((False, 2048),) * 5 and config.block_size == 16
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert config.output_multiplier == PUBLISHED["dflash_config"]["output_multiplier"]
    assert reference_from_config(config, torch.bfloat16) == PUBLISHED


def test_the_published_drafter_has_the_published_tensor_names_and_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED))  # no weights: nothing of 2.7B is allocated
    drafter = DFlash2Drafter.from_pretrained(tmp_path, device="meta")
    names = dict(drafter.state_dict())
    from dflash2.drafter.reference_format import reference_from_state
    shapes = {k: tuple(v.shape) for k, v in reference_from_state(names).items()}
    want = {"fc.weight": (6656, 33280), "norm.weight": (6656,), "hidden_norm.weight": (6656,),
            "candidate_selector.predecessor_codebook": (202048, 256),
            "candidate_selector.successor_codebook": (202048, 256),
            "candidate_selector.hidden_projection.weight": (256, 6656)}
    for i in range(5):
        p = f"layers.{i}."
        want |= {p + "self_attn.q_proj.weight": (4096, 6656), p + "self_attn.k_proj.weight": (1024, 6656),
                 p + "self_attn.v_proj.weight": (1024, 6656), p + "self_attn.o_proj.weight": (6656, 4096),
                 p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
                 p + "mlp.gate_proj.weight": (19968, 6656), p + "mlp.up_proj.weight": (19968, 6656),
                 p + "mlp.down_proj.weight": (6656, 19968), p + "input_layernorm.weight": (6656,),
                 p + "post_attention_layernorm.weight": (6656,)}
        for c in ("attention_conv", "mlp_conv"):
            want |= {p + c + ".base_kernel": (2, 2, 6656), p + c + ".kernel_projection.weight": (1664, 6656)}
    assert shapes == want
    assert all(v.device.type == "meta" and v.dtype == torch.bfloat16 for v in names.values())
    assert sum(v.numel() for v in names.values()) > 2.6e9


def test_gemma_targets_scale_the_raw_embedding_matrix_explicitly():
    """The drafter embeds with the target's raw matrix; Gemma's module multiplies by √H, so from_target
    sets input_embedding_scale to that factor and the block embedding is what the module gives."""
    target = tiny_target("gemma3")
    d = DFlash2Drafter.from_target(target, mask_token_id=MASK, block_size=4)
    assert d.config.input_embedding_scale == pytest.approx(H ** 0.5)
    ids = torch.tensor([[3, MASK, MASK, MASK]])
    adapter = TargetAdapter(target, d.target_layer_ids)
    torch.testing.assert_close(d.embed_block(ids, adapter), target.get_input_embeddings()(ids), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(d.embed_block(ids, adapter),
                               torch.nn.functional.embedding(ids, target.get_input_embeddings().weight) * H ** 0.5)
    assert DFlash2Drafter.from_target(tiny_target("qwen3"), mask_token_id=MASK).config.input_embedding_scale is None


# -- target_hidden_size: a drafter narrower or wider than its target, with its own embedding and head --
WIDTHS = {"narrower": 16, "wider": 48, "as-wide-own-modules": H}  # the target (tiny_target) is H = 32 wide


@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("width", WIDTHS)
def test_a_drafter_of_another_width_drafts_the_published_semantics(tmp_path, width, version):
    cfg = reference_config(version, {"hidden_size": WIDTHS[width], "target_hidden_size": H})
    tensors = reference_tensors(cfg, seed=7, own_modules=True)
    drafter = write(tmp_path, cfg, tensors)
    assert drafter.backbone.fc.weight.shape == (WIDTHS[width], len(LAYER_IDS) * H)
    assert drafter.config.own_embedding and drafter.config.own_lm_head
    worst, differ, total = compare_rounds(drafter, cfg, tensors, seed=7)
    assert worst < 1e-10 and differ == 0, f"{width}: hidden states off by {worst:.2e}, {differ}/{total} drafts differ"


def _without_own(name):
    def mutant(cfg, path, t):  # a reader that shares the target's module although the checkpoint ships its own
        drafter = write(path, cfg, t)
        setattr(drafter, name, None)
        return drafter
    return mutant


@pytest.mark.parametrize("name", ["embed_tokens", "lm_head"])
def test_the_parity_check_fails_when_a_shipped_embedding_or_head_is_ignored(tmp_path, name):
    cfg = reference_config(2, {"target_hidden_size": H})
    tensors = reference_tensors(cfg, seed=7, own_modules=True)
    assert compare_rounds(write(tmp_path / "right", cfg, tensors), cfg, tensors, seed=7)[0] < 1e-10
    worst, differ, _ = compare_rounds(_without_own(name)(cfg, tmp_path / "mutant", tensors), cfg, tensors, seed=7)
    assert worst > 1e-3 or differ > 0, f"ignoring the shipped {name}: the parity check passes"


def test_a_narrower_drafter_holds_in_batches_in_training_and_stays_lossless(tmp_path):
    cfg = reference_config(2, LAYOUTS["mixed-W5-noncausal"] | {"hidden_size": 16, "target_hidden_size": H})
    tensors = reference_tensors(cfg, seed=8, own_modules=True)
    drafter = write(tmp_path, cfg, tensors)
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    embedding = tensors["embed_tokens.weight"]
    context, everything = drafter.new_context_batch(), [features(14, s) for s in range(2)]
    context.add_rows(2)
    news = [everything[r][None, :n] for r, n in enumerate([9, 12])]
    with torch.no_grad():
        drafter.propose_batch(context, [5, 17], news, adapter, 0.0, None)
        hidden = drafter.draft_round_batch(context, [5, 17], None, adapter, B - 1).hidden
    for r, (anchor, n) in enumerate(zip([5, 17], [9, 12])):
        want = ref.block_hidden(cfg, tensors, embedding, everything[r][:n], anchor)
        torch.testing.assert_close(hidden[r], want[1:], rtol=0, atol=1e-10)
    ids = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(5))
    feats, anchors = features(20, 6)[None], torch.tensor([[1, 7, 12]])
    with torch.no_grad():
        out = masked_block_forward(drafter, adapter, ids, feats, anchors)
    for j, a in enumerate(anchors[0].tolist()):
        want = ref.block_hidden(cfg, tensors, embedding, feats[0, :a], int(ids[0, a]))
        torch.testing.assert_close(out.hidden[0, j], want[1:], rtol=0, atol=1e-10)
        torch.testing.assert_close(out.logits[0, j], want[1:] @ tensors["lm_head.weight"].T, rtol=0, atol=1e-10)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for verify in ("path", "tree"):
        got = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=16, verify=verify)
        assert got.sequences[0].tolist() == hf_greedy(target, prompt, 16)
    batch = spec_generate_batch(drafter, target, torch.tensor([prompt, prompt[::-1]]), max_new_tokens=12)
    assert [r.sequences[0].tolist() for r in batch] == [hf_greedy(target, p, 12) for p in (prompt, prompt[::-1])]


def test_a_narrower_drafter_of_ours_exports_its_width_and_modules(tmp_path):
    torch.manual_seed(0)
    d = DFlash2Drafter.from_target(tiny_target("qwen3"), hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                   block_size=B, mask_token_id=MASK, selector_top_k=TOP_K, selector_rank=RANK).double()
    assert (d.config.target_hidden_size, d.config.own_embedding, d.config.own_lm_head) == (H, True, True)
    d.save_pretrained(tmp_path, format="reference")
    out = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert out["hidden_size"] == 16 and out["target_hidden_size"] == H and "has_own_lm_head" not in out
    assert tensors["embed_tokens.weight"].shape == tensors["lm_head.weight"].shape == (VOCAB, 16)
    assert tensors["fc.weight"].shape == (16, len(d.target_layer_ids) * H)
    again = DFlash2Drafter.from_pretrained(tmp_path)
    worst, differ, _ = compare_rounds(again, out, tensors)
    assert worst < 1e-10 and differ == 0
    assert reference_from_config(config_from_reference(out, tensors), torch.float64) == out  # field for field


def test_target_hidden_size_and_own_modules_are_checked_clearly(tmp_path):
    narrow = reference_config(2, {"hidden_size": 16, "target_hidden_size": H})
    tensors = reference_tensors(narrow, own_modules=True)
    for missing in ("embed_tokens.weight", "lm_head.weight"):
        with pytest.raises(ValueError, match=r"target_hidden_size 32 != hidden_size 16: .*own_embedding: true"):
            config_from_reference(narrow, [k for k in tensors if k != missing])
    config = config_from_reference(narrow)  # no weights at hand: a narrower drafter has both
    assert (config.target_hidden_size, config.own_embedding, config.own_lm_head) == (H, True, True)
    equal = config_from_reference(reference_config(2, {"target_hidden_size": H}), [])
    assert (equal.target_hidden_size, equal.own_embedding, equal.own_lm_head) == (H, False, False)
    with pytest.raises(ValueError, match="has_own_lm_head: true but the checkpoint has no lm_head.weight"):
        config_from_reference(reference_config(2, {"has_own_lm_head": True}), [])
    with pytest.raises(ValueError, match=r"target_hidden_size 32 != hidden_size 16"):
        DFlash2Drafter.from_target(tiny_target("qwen3"), hidden_size=16, own_embedding=False, mask_token_id=MASK)
    ignored = {k: v for k, v in narrow.items() if k != "target_hidden_size"}  # a reader that ignores the field
    with pytest.raises(ValueError, match=r"wrong shapes .*fc.weight: \(16, 96\) vs \(16, 48\)"):
        write(tmp_path / "ignored", ignored, tensors)  # cannot load the file: its fc is as wide as the target
