"""DSpark (`Qwen3DSparkModel`) and LiLiCorr (`LiLiCorrDraftModel`) checkpoints draft what vLLM 0.32's
code computes, and are written back field for field.

Random checkpoints are written by vLLM's tensor names (tests.helpers.random_selector_tensors) with
configs written by hand from vLLM's readers, read through `from_pretrained`, and compared with the
independent forward of tests/published_reference.py (`dspark`, `lilicorr_scores`, `lilicorr_walk`,
transcribed from vLLM's files): float64 hidden states to 1e-10, every greedy draft token, DSpark's
confidences, and LiLiCorr's whole score lattice (the greedy walk is blind to a scale; the sampled q is
not; its scores and DSpark's confidences are float32 outputs in vLLM, compared to 1e-6 / 1e-5).
Each published field has a mutant (a reader or a head that ignores it) that must fail. The same
checks against vLLM's own classes run in tests/engines/test_vllm_parity.py when a vLLM venv is named.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2 import DFlash2Drafter, TargetAdapter, spec_generate
from dflash2.drafter.reference_format import config_from_reference, reference_from_config
from tests import published_reference as ref
from tests.helpers import MASK, VOCAB, hf_greedy, random_reference_tensors, random_selector_tensors, tiny_target
from tests.drafter.test_published_semantics import (B, GROUP, H, HD, HEADS, INTER, KV, LAYER_IDS, LAYOUTS, RANK, ROUNDS, TAPS,
                                            TOP_K, features)

DSPARK = {"architectures": ["Qwen3DSparkModel"], "markov_rank": RANK, "dspark_draft_topk": TOP_K,
          "sample_from_anchor": False}
LILICORR = {"architectures": ["LiLiCorrDraftModel"],
            "dflash_config": {"lilicorr_enabled": True, "lilicorr_hidden_size": None, "lilicorr_num_layers": 2,
                              "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
                              "lilicorr_vector_eps": 1e-6, "lilicorr_logit_scale": 10.0,
                              "lilicorr_candidate_topk": TOP_K, "conv_kernel_size": 0, "conv_group_size": 0}}
METHODS = {
    "dspark": DSPARK,
    "dspark-confidence": DSPARK | {"enable_confidence_head": True},
    "dspark-confidence-markov": DSPARK | {"enable_confidence_head": True, "confidence_head_with_markov": True},
    "dspark-alias": DSPARK | {"architectures": ["DSparkDraftModel"]},  # vLLM reads it as Qwen3DSparkModel
    "lilicorr-dflash1": LILICORR,
    "lilicorr-dflash2": {**LILICORR, "dflash_config": LILICORR["dflash_config"] | {"conv_kernel_size": TAPS,
                                                                                  "conv_group_size": GROUP}},
    "lilicorr-narrow": {**LILICORR, "dflash_config": LILICORR["dflash_config"] | {"lilicorr_hidden_size": 16,
                                                                                 "lilicorr_num_heads": 2}},
    "lilicorr-eps": {**LILICORR, "dflash_config": LILICORR["dflash_config"] | {"lilicorr_vector_eps": 5.0,
                                                                              "lilicorr_logit_scale": 3.0}},
    # the drafter's own LM head (LiLiCorr: has_own_lm_head; its candidates still embed with the target's
    # matrix), and a DSpark drafter narrower than its target (own embed_tokens and lm_head)
    "lilicorr-own-head": LILICORR | {"has_own_lm_head": True},
    "dspark-narrow": DSPARK | {"enable_confidence_head": True, "hidden_size": 16, "target_hidden_size": H},
}


def method_config(name: str, layout: dict | None = None) -> dict:
    extra = copy.deepcopy(METHODS[name]) | copy.deepcopy(layout or {})
    cfg = {"model_type": "qwen3", "hidden_size": extra.pop("hidden_size", H), "intermediate_size": INTER, "num_hidden_layers": 2,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 256, "vocab_size": VOCAB, "num_target_layers": 4, "dtype": "float64",
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "block_size": B,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "block_size": B}}
    cfg["dflash_config"] |= extra.pop("dflash_config", {})
    return {"architectures": extra.pop("architectures")} | cfg | extra


def method_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    r = ref.resolve(cfg)
    t = random_reference_tensors(v2=r["v2"], layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=HEADS,
                                 kv_heads=KV, head_dim=HD, intermediate=INTER, n_features=len(LAYER_IDS), vocab=VOCAB,
                                 taps=TAPS, group=GROUP, rank=RANK, seed=seed, scale=0.3, base_offset=0.5,
                                 target_hidden=cfg.get("target_hidden_size"), own_modules="target_hidden_size" in cfg)
    t = {k: v for k, v in t.items() if not k.startswith("candidate_selector.")}  # DFlash 2's codebooks: not theirs
    if cfg.get("has_own_lm_head"):
        t["lm_head.weight"] = torch.randn(VOCAB, cfg["hidden_size"], generator=torch.Generator().manual_seed(seed + 2),
                                          dtype=torch.float64)
    return t | random_selector_tensors(r["method"], cfg, seed + 1)


def write(path, cfg: dict, tensors: dict) -> DFlash2Drafter:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return DFlash2Drafter.from_pretrained(path).eval()


def compare(drafter: DFlash2Drafter, cfg: dict, tensors: dict, seed: int = 0) -> dict[str, float]:
    """Decode-like rounds on one ContextCache against the reference → the largest hidden-state,
    confidence and score differences and the number of draft tokens that differ. The block embeds with
    the checkpoint's embed_tokens and drafts through its lm_head where it ships them; LiLiCorr's
    candidates always embed with the target's matrix (vLLM's speculator)."""
    target = tiny_target("qwen3")
    adapter = TargetAdapter(target, drafter.target_layer_ids)
    embedding = target.get_input_embeddings().weight.detach()
    block_embedding = tensors.get("embed_tokens.weight", embedding)
    head = tensors.get("lm_head.weight", target.get_output_embeddings().weight.detach())
    everything = features(sum(ROUNDS), seed)
    anchors = torch.randint(0, MASK, (len(ROUNDS),), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    cache, start = drafter.new_cache(), 0
    out = {"hidden": 0.0, "confidence": 0.0, "scores": 0.0, "differ": 0, "total": 0}
    method, eps = ref.method(cfg), cfg["rms_norm_eps"]
    for n, anchor in zip(ROUNDS, anchors):
        with torch.no_grad():
            draft = drafter.propose(cache, anchor, everything[None, start:start + n], adapter, 0.0, None)
            ours = drafter.block_hidden(cache, anchor, adapter)[0]
        start += n
        want = ref.block_hidden(cfg, tensors, block_embedding, everything[:start], anchor)
        out["hidden"] = max(out["hidden"], float((ours - want).abs().max()))
        anchor_hidden = ref.rms(everything[start - 1] @ tensors["fc.weight"].T, tensors["hidden_norm.weight"], eps)
        expected = ref.drafts(cfg, tensors, want, head, anchor, embedding, anchor_hidden)
        out["differ"] += sum(a != b for a, b in zip(draft.tokens.tolist(), expected))
        out["total"] += len(expected)
        if method == "dspark" and cfg.get("enable_confidence_head"):
            conf = ref.dspark(cfg, tensors, want, want[1:] @ head.T, anchor)[1]
            out["confidence"] = max(out["confidence"], float((draft.confidence - conf).abs().max()))
        if method == "lilicorr":
            with torch.no_grad():
                cands, log_z = drafter.draft_candidates(ours[1:], adapter, with_log_z=True)
                context = drafter.round_context(cands, log_z, everything[start - 1], adapter)
                first, steps = drafter.candidate_selector.lattice(cands, ours[1:], anchor, context=context)
            logits = want[1:] @ head.T
            ids, log_probs = ref.lilicorr_candidates(cfg, logits)
            scores = ref.lilicorr_scores(cfg, tensors, ids, log_probs, want[1:], embedding, anchor_hidden)
            assert torch.equal(cands.ids, ids)
            out["scores"] = max(out["scores"], float((first - scores[0, 0]).abs().max()),
                                float((steps - scores[1:]).abs().max()))
    return out


def assert_agrees(result: dict, what: str) -> None:
    assert result["hidden"] < 1e-10 and result["differ"] == 0, f"{what}: {result}"
    assert result["confidence"] < 1e-6 and result["scores"] < 1e-5, f"{what}: {result}"  # both float32 outputs


@pytest.mark.parametrize("layout", ["full-bidirectional", "mixed-W5-noncausal"])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_drafts_as_vllm_computes(tmp_path, method, layout):
    cfg = method_config(method, LAYOUTS[layout])
    tensors = method_tensors(cfg)
    drafter = write(tmp_path, cfg, tensors)
    assert drafter.config.selector == ref.method(cfg)
    assert_agrees(compare(drafter, cfg, tensors), f"{method} / {layout}")


@pytest.mark.parametrize("method", METHODS)
def test_each_method_round_trips_field_for_field_and_bit_for_bit(tmp_path, method):
    cfg = method_config(method)
    tensors = method_tensors(cfg)
    drafter = write(tmp_path / "src", cfg, tensors)
    drafter.save_pretrained(tmp_path / "back", format="reference")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == cfg
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("method", ["dspark-confidence-markov", "lilicorr-dflash2"])
def test_a_loaded_method_checkpoint_is_lossless(tmp_path, method):
    cfg = method_config(method)
    drafter = write(tmp_path, cfg, method_tensors(cfg))
    target = tiny_target("qwen3")
    for prompt in ([3, 1, 4], [2, 7, 1, 8, 2, 8]):
        for verify in ("path", "tree"):
            out = spec_generate(drafter, target, torch.tensor([prompt]), max_new_tokens=16, verify=verify)
            assert out.sequences[0].tolist() == hf_greedy(target, prompt, 16)


@pytest.mark.parametrize("selector, conv, fields", [
    ("dspark", "none", {"confidence_head": True, "confidence_with_markov": True}),
    ("dspark", "none", {}),
    ("lilicorr", "none", {}),
    ("lilicorr", "two_tap", {"lilicorr_hidden_size": 16, "lilicorr_num_heads": 2}),
])
def test_our_method_drafters_export_what_vllm_reads(tmp_path, selector, conv, fields):
    """A drafter of ours, written in its published format, is read by the independent forward as drafting
    what ours drafts; the exported config carries every field vLLM reads (and sample_from_anchor: false)."""
    torch.manual_seed(0)
    ours = DFlash2Drafter.from_target(tiny_target("qwen3"), block_size=B, mask_token_id=MASK, selector=selector,
                                      conv=conv, selector_top_k=TOP_K, selector_rank=RANK, lilicorr_factor_dim=8,
                                      **fields).double()
    if selector == "dspark":
        torch.nn.init.normal_(ours.candidate_selector.markov_head.markov_w2.weight, std=1.0)
    ours.save_pretrained(tmp_path, format="reference")
    cfg = json.loads((tmp_path / "config.json").read_text())
    if selector == "dspark":
        assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is False
        assert (cfg["markov_rank"], cfg["dspark_draft_topk"]) == (RANK, TOP_K)
        assert cfg["enable_confidence_head"] is bool(fields)
        assert "conv_kernel_size" not in cfg["dflash_config"]
    else:
        d = cfg["dflash_config"]
        assert cfg["architectures"] == ["LiLiCorrDraftModel"] and d["lilicorr_enabled"] is True
        assert d["lilicorr_candidate_topk"] == TOP_K and d["conv_kernel_size"] == (TAPS if conv == "two_tap" else 0)
        assert all(k in d for k in METHODS["lilicorr-dflash1"]["dflash_config"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.startswith(("backbone.", "candidate_selector.")) for k in tensors)
    assert_agrees(compare(DFlash2Drafter.from_pretrained(tmp_path).eval(), cfg, tensors), selector)


def _with(cfg: dict, **top) -> dict:
    out = copy.deepcopy(cfg)
    for k, v in top.items():
        (out["dflash_config"] if k.startswith(("lilicorr_", "conv_")) else out)[k] = v
    return out


def _patch(drafter: DFlash2Drafter, **attrs) -> DFlash2Drafter:
    for k, v in attrs.items():
        setattr(drafter.candidate_selector, k, v)
    return drafter


def _markov_from_anchor(drafter):
    """The Markov bias always from the anchor, never from the token drafted before."""
    sel = drafter.candidate_selector
    edge = sel.edge_scores
    return _patch(drafter, edge_scores=lambda prev, hidden, cand: edge(torch.zeros_like(prev), hidden, cand))


def _confidence_without_markov(drafter):
    sel = drafter.candidate_selector
    proj = sel.confidence_head.proj
    return _patch(drafter, confidence_logits=lambda hidden, prev: proj(
        torch.cat([hidden, torch.zeros_like(sel.markov_head.markov_w1.weight[prev])], -1))[..., 0].float())


def _anchor_state_zero(drafter):
    sel = drafter.candidate_selector
    scores = sel.scores
    return _patch(drafter, scores=lambda cands, hidden, context: scores(
        cands, hidden, context._replace(anchor_state=torch.zeros_like(context.anchor_state))))


def _relative_offset(drafter):
    """The relative-slot bias indexed from the scored length, not the trained block (vLLM keeps B - 1)."""
    sel = drafter.candidate_selector

    def bias(slots):
        slot = torch.arange(slots).repeat_interleave(sel.top_k)
        rel = slot[:, None] - slot[None, :]
        return sel.relative_slot_bias[:, rel + slots - 2] + (rel == 0).to(torch.float64) * sel.same_slot_bias[:, None, None]
    return _patch(drafter, attention_bias=bias)


# each: (method, how the mutant is made from (cfg, path, tensors)) → a drafter that must disagree
MUTANTS = {
    "dspark_draft_topk ignored (all candidates)": (
        "dspark", lambda cfg, path, t: write(path, _with(cfg, dspark_draft_topk=VOCAB // 2), t)),
    "markov bias from the anchor only": ("dspark", lambda cfg, path, t: _markov_from_anchor(write(path, cfg, t))),
    "confidence without the markov embedding": (
        "dspark-confidence-markov", lambda cfg, path, t: _confidence_without_markov(write(path, cfg, t))),
    "lilicorr_logit_scale ignored": (
        "lilicorr-eps", lambda cfg, path, t: _patch(write(path, cfg, t), logit_scale=10.0)),
    "lilicorr_vector_eps ignored": (
        "lilicorr-eps", lambda cfg, path, t: _patch(write(path, cfg, t), vector_eps=1e-6)),
    "anchor state ignored": ("lilicorr-dflash2", lambda cfg, path, t: _anchor_state_zero(write(path, cfg, t))),
    "relative-slot offset from the draft length": (
        "lilicorr-dflash1", lambda cfg, path, t: _relative_offset(write(path, cfg, t))),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_method_parity_check_fails_on_mutants(tmp_path, mutant):
    method, make = MUTANTS[mutant]
    cfg = method_config(method)
    tensors = method_tensors(cfg)
    assert_agrees(compare(write(tmp_path / "right", cfg, tensors), cfg, tensors), "unmutated")
    result = compare(make(cfg, tmp_path / "mutant", tensors), cfg, tensors)
    assert result["differ"] > 0 or result["confidence"] > 1e-3 or result["scores"] > 1e-3, \
        f"{mutant}: the parity check passes ({result})"


@pytest.mark.parametrize("method, edit, message", [
    ("dspark", lambda c: c.pop("sample_from_anchor"), "anchor-as-first"),
    ("dspark", lambda c: c.update(sample_from_anchor=True), "anchor-as-first"),
    ("dspark", lambda c: c.pop("dspark_draft_topk"), "dspark_draft_topk"),
    ("dspark", lambda c: c.pop("markov_rank"), "markov_rank"),
    ("dspark", lambda c: c.update(logit_scale=2.0), "logit_scale"),
    ("dspark", lambda c: c.update(markov_head_type="gated"), "vanilla"),
    ("dspark", lambda c: c.update(draft_vocab_size=VOCAB // 2), "draft_vocab_size"),
    ("lilicorr-dflash1", lambda c: c["dflash_config"].update(lilicorr_enabled=False), "lilicorr_enabled"),
    ("lilicorr-dflash1", lambda c: c["dflash_config"].pop("lilicorr_factor_dim"), "lilicorr_factor_dim"),
    ("lilicorr-dflash1", lambda c: c["dflash_config"].update(conv_kernel_size=2), "both or neither"),
    ("lilicorr-dflash1", lambda c: c.update(target_hidden_size=2 * H), "embedded with the target's matrix"),
    ("lilicorr-dflash1", lambda c: c["dflash_config"].update(lilicorr_candidate_topk=3), "power of two"),
])
def test_unsupported_or_broken_method_configs_are_refused_clearly(method, edit, message):
    cfg = method_config(method)
    edit(cfg)
    with pytest.raises(ValueError, match=message):
        config_from_reference(cfg)


@pytest.mark.parametrize("method, edit, message", [
    ("dspark-confidence", lambda t: t.pop("confidence_head.proj.bias"), "missing"),
    ("dspark", lambda t: t.__setitem__("confidence_head.proj.bias", torch.zeros(1, dtype=torch.float64)), "unused"),
    ("dspark-confidence", lambda t: t.__setitem__("confidence_head.proj.weight",  # with_markov's width, not set
                                                  torch.zeros(1, H + RANK, dtype=torch.float64)), "wrong shapes"),
    ("lilicorr-dflash1", lambda t: t.pop("lilicorr.layers.1.attn.in_proj_bias"), "missing"),
    ("lilicorr-dflash1", lambda t: t.__setitem__("lilicorr.token_proj.weight", torch.zeros(H, H)), "unused"),
    ("lilicorr-own-head", lambda t: t.pop("lm_head.weight"), "has_own_lm_head: true but the checkpoint has no lm_head"),
    ("lilicorr-dflash1", lambda t: t.__setitem__("lm_head.weight", torch.zeros(VOCAB, H, dtype=torch.float64)),
     "without has_own_lm_head: true"),
    ("dspark-narrow", lambda t: t.pop("embed_tokens.weight"), "target_hidden_size 32 != hidden_size 16"),
])
def test_method_checkpoints_load_strictly(tmp_path, method, edit, message):
    cfg = method_config(method)
    tensors = method_tensors(cfg)
    edit(tensors)
    with pytest.raises(ValueError, match=message):
        write(tmp_path, cfg, tensors)


def test_dspark_without_the_confidence_flag_is_written_back_without_it():
    cfg = method_config("dspark")
    assert "enable_confidence_head" not in reference_from_config(config_from_reference(cfg), torch.float64)
    flag = cfg | {"enable_confidence_head": False, "confidence_head_with_markov": True}  # ignored, as vLLM does
    assert reference_from_config(config_from_reference(flag), torch.float64) == flag
