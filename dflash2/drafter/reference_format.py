"""The published checkpoint formats: DFlash (`DFlashDraftModel`), DFlash 2 (`DFlash2DraftModel`),
DSpark (`Qwen3DSparkModel`) and LiLiCorr (`LiLiCorrDraftModel`), as vLLM 0.32 loads them.

A reference directory holds a Qwen3-style `config.json` (drafter sizes, `num_target_layers`, a
`dflash_config` section) and a `model.safetensors` whose tensor names are ours without `backbone.`;
the selector's tensors are DFlash 2's `candidate_selector.*`, DSpark's `markov_head.*` and
`confidence_head.*`, LiLiCorr's `lilicorr.*`. Loading is strict: every tensor used, none missing,
every shape fitting. DSpark files must say `sample_from_anchor: false` (the anchor-as-first layout is
refused with that reason).

The config is read as the published drafters read it (a `dflash_config` entry wins over a top-level
one; `sliding_window` counts only with `use_sliding_window: true`; `layer_types` derive from
`max_window_layers` when absent; RoPE from `rope_parameters` or `rope_theta` + `rope_scaling`).
Fields dflash2 does not model are kept in `DFlash2Config.extra` and written back, so an imported
config round-trips field for field (docs/checkpoints.md lists every field).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor

from dflash2.config import DFlash2Config
from dflash2.drafter.reference_rope import qwen3_defaults, rope_from_reference, rope_to_reference

V1, V2, DSPARK, LILICORR = "DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel", "LiLiCorrDraftModel"
ARCHITECTURES = (V1, V2, DSPARK, LILICORR)
DSPARK_ALIAS = "DSparkDraftModel"  # vLLM reads it as Qwen3DSparkModel when model_type is qwen3
PREFIX = "backbone."
OWN_MODULES = ("embed_tokens.", "lm_head.")  # the drafter's own embedding and LM head: the same names in both
SELECTOR = "candidate_selector."
# where each format keeps the selector's tensors (ours: candidate_selector.*)
SELECTOR_PREFIX = {V2: SELECTOR, DSPARK: "", LILICORR: "lilicorr."}
LILICORR_FIELDS = ("lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_mlp_ratio",
                   "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Qwen3 config field → DFlash2Config field
SIZES = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
         "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
         "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
         "vocab_size": "vocab_size"}
V2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
# top-level fields whose presence in an imported config is remembered, to write back the same set
TRACKED = ("has_own_lm_head", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "layer_types",
           "sliding_window", "use_sliding_window", "is_causal", "dtype", "torch_dtype", "is_neox_style")
SINK_TOP_LEVEL = "add_swa_attention_sink_bias"  # the sink flag's top-level name (MiMo-style configs)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def architecture(meta: dict[str, Any]) -> str | None:
    """The reference architecture a config.json declares (None: not a reference file)."""
    names = list(meta.get("architectures") or [])
    if DSPARK_ALIAS in names and meta.get("model_type") == "qwen3":
        names = [DSPARK if a == DSPARK_ALIAS else a for a in names]
    found = [a for a in names if a in ARCHITECTURES]
    return found[0] if found else None


def is_reference(meta: dict[str, Any]) -> bool:
    return architecture(meta) is not None


def config_from_reference(meta: dict[str, Any], tensor_names: Collection[str] | None = None) -> DFlash2Config:
    """A reference config.json → DFlash2Config (v1: no conv, argmax; v2: two-tap conv, walk; DSpark:
    no conv, the Markov selector; LiLiCorr: the lattice transformer on either backbone).

    `tensor_names`: the checkpoint's tensor names, which decide (as in vLLM) whether the drafter has its
    own embedding (`embed_tokens.weight`) and LM head (`lm_head.weight`; LiLiCorr: `has_own_lm_head`);
    None (no weights at hand): it has them when `target_hidden_size` differs from `hidden_size`."""
    meta = dict(meta)
    arch = architecture(meta)
    declared = meta.pop("architectures")
    dflash = dict(meta.pop("dflash_config", None) or {})
    present = [k for k in TRACKED if k in meta]
    top_level: list[str] = []

    def take(name: str, default: Any = None) -> Any:
        """dflash_config first, then the top level (the reference's `_draft_value`)."""
        if name in dflash:
            return dflash.pop(name)
        if name in meta:
            top_level.append(name)
            return meta.pop(name)
        return default

    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash and k not in meta]
    missing += [] if "num_target_layers" in meta else ["num_target_layers"]
    if missing:
        raise ValueError(f"reference config lacks {missing}")
    if meta.get("attention_bias"):
        raise ValueError("reference config has attention_bias: true; dflash2's drafter layers have no projection biases")
    if meta.get("hidden_act", "silu") != "silu":
        raise ValueError(f"reference config has hidden_act {meta['hidden_act']!r}; dflash2's MLP is SwiGLU (silu)")
    qwen3 = qwen3_defaults()
    fields: dict[str, Any] = {ours: meta.pop(theirs) if theirs in meta else getattr(qwen3, theirs)
                              for theirs, ours in SIZES.items()}
    fields["num_target_layers"] = meta.pop("num_target_layers")
    top_block = meta.pop("block_size", None)
    fields["block_size"] = int(dflash.pop("block_size", None) or top_block or 16)
    fields["mask_token_id"] = take("mask_token_id")
    fields["target_layer_ids"] = tuple(take("target_layer_ids"))
    for name in (*(V2_FIELDS if arch in (V1, V2) else ()), *OPTIONS):
        value = take(name)
        if value is not None:
            fields[name] = value
    value_scale = take("attention_value_scale")
    if value_scale is not None:
        fields["attention_value_scale"] = float(value_scale)
    sink = dflash.pop("attention_sink_bias", None)  # vLLM: dflash_config first, then the top-level name
    if sink is None and SINK_TOP_LEVEL in meta:
        sink = meta.pop(SINK_TOP_LEVEL)
        top_level.append(SINK_TOP_LEVEL)
    fields["attention_sink_bias"] = bool(sink)
    fields["rope_interleaved"] = meta.pop("is_neox_style", True) is False  # rotary layout of the draft's own Q/K
    if not fields.get("final_logit_softcapping"):  # the reference: a cap of 0 or null is off
        fields.pop("final_logit_softcapping", None)
    method_extra = _method_from_reference(arch, meta, dflash, fields, take)
    _own_modules_from_reference(arch, meta, fields, tensor_names)
    draft_vocab = meta.pop("draft_vocab_size", None)
    if draft_vocab is not None and draft_vocab != fields["vocab_size"]:  # a reduced head and its d2t (EAGLE-3's)
        if tensor_names is not None and not {"d2t", "lm_head.weight"} <= set(tensor_names):
            raise ValueError(f"draft_vocab_size {draft_vocab} < vocab_size {fields['vocab_size']} needs the tensors d2t "
                             "and lm_head.weight (its rows), which the checkpoint lacks")
        fields["draft_vocab_size"], fields["own_lm_head"] = int(draft_vocab), True
    fields["rope_parameters"] = rope_from_reference(meta)
    # attention layout, as Qwen3Config resolves it
    use_window = bool(meta.pop("use_sliding_window", False))
    raw_window = meta.pop("sliding_window", None)
    window = raw_window if use_window else None
    types = meta.pop("layer_types", None)
    if types is None:
        start = meta.get("max_window_layers", qwen3.max_window_layers)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(fields["num_layers"])]
    given_types = "layer_types" in present
    fields["layer_types"] = () if all(t == "full_attention" for t in types) and not given_types else tuple(types)
    fields["sliding_window"] = window
    fields["is_causal"] = None if meta.get("is_causal") is None else bool(meta.pop("is_causal"))
    meta.pop("is_causal", None)
    # vLLM's fields (its _resolve_layer_attention over the Qwen3Config it builds), read and kept in
    # dflash_config as written: `use_swa` makes every layer slide unless layer_types already has sliding
    # ones; the window is `swa_window_size`, else Qwen3Config's sliding_window (None without
    # use_sliding_window: refused, as vLLM refuses it); `causal` decides for every layer unless is_causal
    # does; without either, layers that slide only by use_swa are bidirectional.
    if dflash.get("use_swa") or "swa_window_size" in dflash:
        window = dflash.get("swa_window_size", window)
        any_sliding = given_types and "sliding_attention" in types
        if dflash.get("use_swa") and not any_sliding:
            fields["layer_types"] = ("sliding_attention",) * fields["num_layers"]
            if fields["is_causal"] is None and dflash.get("causal") is None:
                fields["is_causal"] = False
        if any(t == "sliding_attention" for t in fields["layer_types"]):
            if window is None:
                raise ValueError("dflash_config.use_swa needs a window: dflash_config.swa_window_size, or sliding_window "
                                 "with use_sliding_window: true (vLLM refuses the file too)")
            fields["sliding_window"] = int(window)
    if fields["is_causal"] is None and dflash.get("causal") is not None:
        fields["is_causal"] = bool(dflash["causal"])
    meta.pop("dtype", None), meta.pop("torch_dtype", None)
    fields["extra"] = {"architecture": arch, "config": meta, "dflash_config": dflash, "top_block_size": top_block,
                       "present": present, "top_level": top_level,
                       "ignored_sliding_window": None if use_window else raw_window, **method_extra}
    if declared != [arch]:
        fields["extra"]["architectures"] = declared
    return DFlash2Config(**fields)


def _own_modules_from_reference(arch: str, meta: dict[str, Any], fields: dict[str, Any],
                                tensor_names: Collection[str] | None) -> None:
    """target_hidden_size and the drafter's own embedding / LM head, as vLLM reads them: the fc reads
    len(target_layer_ids) × target_hidden_size features; a checkpoint that ships `embed_tokens` or
    `lm_head` keeps its own (the engine shares the target's otherwise); LiLiCorr uses its own head iff
    `has_own_lm_head` and always embeds its candidates with the target's matrix."""
    width = meta.pop("target_hidden_size", None)
    own_head_flag = bool(meta.pop("has_own_lm_head", False))
    differs = width is not None and width != fields["hidden_size"]
    if tensor_names is None:
        own_embedding, own_head = differs, differs or own_head_flag
    else:
        own_embedding, own_head = "embed_tokens.weight" in tensor_names, "lm_head.weight" in tensor_names
    if own_head_flag and not own_head:
        raise ValueError("reference config has has_own_lm_head: true but the checkpoint has no lm_head.weight")
    if arch == LILICORR:
        if differs:
            raise ValueError(f"LiLiCorr config has target_hidden_size {width} != hidden_size {fields['hidden_size']}: "
                             "its candidates are embedded with the target's matrix, which must be as wide as the "
                             "drafter (vLLM refuses the file too)")
        if own_head and not own_head_flag:
            raise ValueError("LiLiCorr checkpoint ships lm_head.weight without has_own_lm_head: true (vLLM would use "
                             "the target's head and ignore it)")
    if width is not None:
        fields["target_hidden_size"] = int(width)
    fields["own_embedding"], fields["own_lm_head"] = own_embedding, own_head


def _method_from_reference(arch: str, meta: dict[str, Any], dflash: dict[str, Any], fields: dict[str, Any],
                           take) -> dict[str, Any]:
    """The conv and selector fields each architecture implies; returns what to remember for the export."""
    if arch == V1:
        fields.update(conv="none", selector="argmax")
    elif arch == V2:
        fields.update(conv="two_tap", selector="walk")
    elif arch == DSPARK:
        anchor_first = meta.pop("sample_from_anchor", True)  # vLLM's default: the anchor-as-first layout
        if anchor_first is not False:
            raise ValueError("this DSpark checkpoint drafts anchor-as-first (sample_from_anchor is true or absent, "
                             "vLLM's default): the anchor's own output predicts the first draft token. dflash2 drafts "
                             "the DFlash 1 + N block (sample_from_anchor: false) only; the anchor-as-first layout "
                             "is not supported yet")
        if meta.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"DSpark markov_head_type {meta['markov_head_type']!r}: dflash2 has the vanilla "
                             "low-rank head only")
        if meta.get("logit_scale", 1.0) != 1.0:
            raise ValueError(f"DSpark logit_scale {meta['logit_scale']}: dflash2's drafters have none (1.0)")
        draft_vocab = meta.get("draft_vocab_size")
        if draft_vocab is not None and draft_vocab != fields["vocab_size"]:
            raise ValueError(f"DSpark draft_vocab_size {draft_vocab} != vocab_size {fields['vocab_size']}: a reduced "
                             "draft vocabulary (d2t) is not read from this format")
        if meta.get("markov_rank") is None:
            raise ValueError("DSpark config lacks markov_rank")
        if meta.get("dspark_draft_topk") is None:
            raise ValueError("DSpark config has no dspark_draft_topk: the full-vocabulary Markov draft is not "
                             "supported; add dspark_draft_topk (the candidates per position, as vLLM's "
                             "--speculative-config dspark_draft_topk sets it) to config.json")
        fields.update(conv="none", selector="dspark", selector_rank=int(meta.pop("markov_rank")),
                      selector_top_k=int(meta.pop("dspark_draft_topk")))
        head = meta.pop("enable_confidence_head", None)
        markov_flag = "confidence_head_with_markov" in meta
        fields["confidence_head"] = bool(head)
        if head:  # without the head vLLM ignores the flag: kept as written
            fields["confidence_with_markov"] = bool(meta.pop("confidence_head_with_markov", False))
        return {"dspark_confidence_flag": head is not None, "dspark_markov_flag": markov_flag}
    else:  # LILICORR
        if not dflash.pop("lilicorr_enabled", True):
            raise ValueError("LiLiCorr config has lilicorr_enabled: false (vLLM refuses it too)")
        explicit = "conv_kernel_size" in dflash
        taps, groups = dflash.pop("conv_kernel_size", 0), dflash.pop("conv_group_size", 0)
        if bool(taps) != bool(groups):
            raise ValueError(f"LiLiCorr conv_kernel_size {taps} and conv_group_size {groups}: both or neither")
        missing = [k for k in (*LILICORR_FIELDS, "lilicorr_candidate_topk") if k not in dflash]
        if missing:
            raise ValueError(f"LiLiCorr config lacks dflash_config {missing} (vLLM reads every one)")
        fields.update(selector="lilicorr", selector_top_k=int(dflash.pop("lilicorr_candidate_topk")),
                      conv="two_tap" if taps else "none")
        if taps:
            fields.update(conv_kernel_size=int(taps), conv_group_size=int(groups))
        for name in LILICORR_FIELDS:
            fields[name] = dflash.pop(name)
        raw_width = fields["lilicorr_hidden_size"]
        fields["lilicorr_hidden_size"] = raw_width or None  # 0 / null: the drafter's width
        return {"lilicorr_zero_conv": explicit and not taps, "lilicorr_raw_width": raw_width}
    return {}


def reference_architecture(config: DFlash2Config) -> str:
    """The published architecture a drafter of this config exports as; ValueError where it has none."""
    from dflash2.drafter.selectors.codebook import BUILTIN

    if config.conv not in ("two_tap", "none") or config.selector not in (*BUILTIN, "dspark", "lilicorr"):
        raise ValueError(f"the reference format knows the built-in pieces only (selector {[*BUILTIN, 'dspark', 'lilicorr']}"
                         f", conv two_tap or none); this drafter has selector={config.selector!r}, conv={config.conv!r}:"
                         " save it with format='dflash2'")
    if config.selector == "lilicorr":
        return LILICORR  # on either backbone
    if config.selector == "dspark":
        if config.conv != "none":
            raise ValueError("DSpark's published format (Qwen3DSparkModel) has the DFlash-1 backbone: conv="
                             f"{config.conv!r} with selector='dspark' has no reference form")
        return DSPARK
    v2 = config.conv == "two_tap"
    if v2 != (config.selector != "argmax"):
        raise ValueError("the reference format has DFlash 1 (no conv, argmax) and DFlash 2 (conv, selector) only; "
                         f"conv={config.conv!r} with selector={config.selector!r} has no reference form")
    return V2 if v2 else V1


def reference_from_config(config: DFlash2Config, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """DFlash2Config → reference config.json (the architecture of `reference_architecture`); `dtype` is the
    weights' dtype, written as `dtype`. The run-time `context_window` is not part of the format
    (the engines take it as their serving flag, --speculative-draft-window-size)."""
    extra = config.extra or {}
    arch = reference_architecture(config)
    v2 = arch == V2
    imported = "present" in extra
    present = set(extra.get("present", ()))
    top_level = set(extra.get("top_level", ()))
    same = extra.get("architecture") == arch  # written back as the imported file declared it
    meta: dict[str, Any] = {"architectures": list(extra.get("architectures", [arch])) if same else [arch],
                            "model_type": "qwen3"}
    meta.update(extra.get("config", {}))
    meta.update({theirs: getattr(config, ours) for theirs, ours in SIZES.items()})
    meta["num_target_layers"] = config.num_target_layers
    if extra.get("top_block_size", config.block_size) is not None:  # kept unless the imported file lacked it
        meta["block_size"] = config.block_size
    meta.update(rope_to_reference(config.rope_parameters, present if imported else {"rope_parameters"}))
    # attention layout: explicit wherever an engine could read it differently
    layout = config.attention_layout
    sliding = [t == "sliding_attention" for t in (config.layer_type(i) for i in range(config.num_layers))]
    if any(sliding) or "layer_types" in present or config.layer_types:
        meta["layer_types"] = [config.layer_type(i) for i in range(config.num_layers)]
    if config.sliding_window is not None:
        meta["use_sliding_window"], meta["sliding_window"] = True, config.sliding_window
    elif extra.get("ignored_sliding_window") is not None:
        meta["use_sliding_window"], meta["sliding_window"] = False, extra["ignored_sliding_window"]
    elif "use_sliding_window" in present:
        meta["use_sliding_window"] = False
    causal = {c for c, _ in layout}
    if config.is_causal is not None:
        meta["is_causal"] = config.is_causal
    elif len(causal) == 1 and (any(sliding) or not imported or "is_causal" in present):
        meta["is_causal"] = causal.pop()  # the resolved value, one for every layer
    if dtype is not None:
        name = {v: k for k, v in DTYPES.items()}[dtype]
        meta["dtype"] = name
        if "torch_dtype" in present:
            meta["torch_dtype"] = name
    dflash = dict(extra.get("dflash_config", {}))
    dflash.update(mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
                  block_size=config.block_size)
    if v2:
        dflash.update({name: getattr(config, name) for name in V2_FIELDS})
    elif arch == DSPARK:
        meta.update(markov_rank=config.selector_rank, dspark_draft_topk=config.selector_top_k,
                    sample_from_anchor=False)
        if config.confidence_head or extra.get("dspark_confidence_flag", not same):
            meta["enable_confidence_head"] = config.confidence_head
        if config.confidence_with_markov or config.confidence_head and extra.get("dspark_markov_flag", not same):
            meta["confidence_head_with_markov"] = config.confidence_with_markov
    elif arch == LILICORR:
        dflash.update({name: getattr(config, name) for name in LILICORR_FIELDS},
                      lilicorr_enabled=True, lilicorr_candidate_topk=config.selector_top_k)
        if config.lilicorr_hidden_size is None:
            dflash["lilicorr_hidden_size"] = extra.get("lilicorr_raw_width") if same else None
        if config.conv == "two_tap":
            dflash.update(conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size)
        elif extra.get("lilicorr_zero_conv", not same):
            dflash.update(conv_kernel_size=0, conv_group_size=0)
    for name in OPTIONS:
        if getattr(config, name) is not None:
            dflash[name] = getattr(config, name)
    if config.attention_value_scale is not None:
        dflash["attention_value_scale"] = config.attention_value_scale
    if config.attention_sink_bias:
        dflash[SINK_TOP_LEVEL if SINK_TOP_LEVEL in top_level else "attention_sink_bias"] = True
    if config.target_hidden_size is not None:
        meta["target_hidden_size"] = config.target_hidden_size
    if config.own_lm_head and (arch == LILICORR or "has_own_lm_head" in present):
        meta["has_own_lm_head"] = True
    elif "has_own_lm_head" in present:
        meta["has_own_lm_head"] = False
    if config.rope_interleaved or "is_neox_style" in present:
        meta["is_neox_style"] = not config.rope_interleaved
    for name in top_level:  # fields the imported file kept at the top level go back there
        if name in dflash:
            meta[name] = dflash.pop(name)
    meta["dflash_config"] = dflash
    meta = {k: v for k, v in meta.items() if v is not None}
    return {"architectures": meta.pop("architectures"), "model_type": meta.pop("model_type"),
            **dict(sorted(meta.items()))}


def _ours(name: str, arch: str) -> str:
    """A published tensor name → ours (the selector's under candidate_selector., the drafter's own
    embed_tokens / lm_head as they are, the rest under backbone.)."""
    if name.startswith(OWN_MODULES):
        return name
    if arch == DSPARK and name.startswith(("markov_head.", "confidence_head.")):
        return SELECTOR + name
    if arch == LILICORR and name.startswith("lilicorr."):
        return SELECTOR + name[len("lilicorr."):]
    if arch == V2 and name.startswith(SELECTOR):
        return name[: -len(".weight")] if name.endswith(".weight") and name[: -len(".weight")] in CODEBOOKS else name
    return PREFIX + name


def _theirs(name: str, arch: str) -> str:
    if name.startswith(SELECTOR):
        return SELECTOR_PREFIX[arch] + name[len(SELECTOR):]
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def state_from_reference(tensors: dict[str, Tensor], expected: dict[str, Tensor], arch: str = V2
                         ) -> dict[str, Tensor]:
    """Reference tensors → our state dict; strict. Codebooks with or without a `.weight` suffix."""
    state = {}
    for name, tensor in tensors.items():
        ours = _ours(name, arch)
        if ours in state:
            raise ValueError(f"reference checkpoint holds {ours} twice (with and without .weight)")
        state[ours] = tensor
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        missing, unexpected = [_theirs(k, arch) for k in missing], [_theirs(k, arch) for k in unexpected]
        raise ValueError(f"reference checkpoint does not fit the config: missing {missing}, unused {unexpected}")
    wrong = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        raise ValueError(f"reference tensors with wrong shapes (file vs config): {wrong}")
    return state


def reference_from_state(state: dict[str, Tensor], arch: str = V2) -> dict[str, Tensor]:
    """Our state dict → the published tensor names (codebooks without `.weight`, as released)."""
    return {_theirs(name, arch): tensor for name, tensor in state.items()}


def split_draft_head(tensors: dict[str, Tensor], vocab_size: int) -> tuple[dict[str, Tensor], Tensor]:
    """A reduced-vocabulary checkpoint (`d2t` offsets: draft row i is token i + d2t[i]; `lm_head.weight`
    [n, H], those tokens' rows) → its tensors with the head spread into a [vocab_size, H] matrix (zero
    rows outside the draft vocabulary, which never drafts them), and the draft vocabulary's token ids."""
    tensors = dict(tensors)
    d2t, rows = tensors.pop("d2t").long(), tensors["lm_head.weight"]
    ids = torch.arange(d2t.numel()) + d2t
    head = torch.zeros(vocab_size, rows.shape[1], dtype=rows.dtype)
    head[ids] = rows
    tensors["lm_head.weight"] = head
    return tensors, ids


def join_draft_head(tensors: dict[str, Tensor], ids: Tensor, head: Tensor) -> dict[str, Tensor]:
    """The reverse: the draft vocabulary's rows of `head` [V, H] as lm_head.weight [n, H], and d2t."""
    return dict(tensors, **{"lm_head.weight": head[ids].contiguous(), "d2t": ids - torch.arange(ids.numel())})

