"""The published DFlash (`DFlashDraftModel`) and DFlash 2 (`DFlash2DraftModel`) checkpoint format.

A reference directory holds a Qwen3-style `config.json` (drafter sizes, `num_hidden_layers` = drafter
layers) with top-level `block_size`, `num_target_layers` and a `dflash_config` section, and a
`model.safetensors` whose tensor names are ours without the `backbone.` prefix (design doc
section 3); the codebooks may or may not carry a `.weight` suffix. The mapping is strict: every
tensor is used, none is missing, every shape must fit. Fields we do not model are kept in
`DFlash2Config.extra` and written back, so a round trip reproduces names and tensors exactly.
See docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .config import DFlash2Config

V1, V2 = "DFlashDraftModel", "DFlash2DraftModel"
ARCHITECTURES = (V1, V2)
PREFIX = "backbone."
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Qwen3 config field → DFlash2Config field
SIZES = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
         "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
         "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
         "vocab_size": "vocab_size"}
DFLASH_FIELDS = ("mask_token_id", "target_layer_ids", "block_size", "conv_kernel_size", "conv_group_size",
                 "selector_rank", "selector_top_k")
OPTIONS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")


def is_reference(meta: dict[str, Any]) -> bool:
    return any(a in ARCHITECTURES for a in meta.get("architectures", []))


def config_from_reference(meta: dict[str, Any]) -> DFlash2Config:
    """A reference config.json → DFlash2Config (v1: no conv, argmax; v2: two-tap conv, walk)."""
    meta = dict(meta)
    (arch,) = [a for a in meta.pop("architectures") if a in ARCHITECTURES]
    dflash = dict(meta.pop("dflash_config", None) or {})
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if missing or "num_target_layers" not in meta:
        raise ValueError(f"reference config lacks {missing + ([] if 'num_target_layers' in meta else ['num_target_layers'])}")
    fields: dict[str, Any] = {ours: meta.pop(theirs) for theirs, ours in SIZES.items() if theirs in meta}
    fields["num_target_layers"] = meta.pop("num_target_layers")
    top_block = meta.pop("block_size", None)
    fields["block_size"] = dflash.pop("block_size", top_block) or 16
    rope = meta.pop("rope_theta", None)
    if rope is None and isinstance(meta.get("rope_parameters"), dict):
        rope = meta["rope_parameters"].get("rope_theta")
    if rope is not None:
        fields["rope_theta"] = float(rope)
    fields["mask_token_id"] = dflash.pop("mask_token_id")
    fields["target_layer_ids"] = tuple(dflash.pop("target_layer_ids"))
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", *OPTIONS):
        if name in dflash:
            fields[name] = dflash.pop(name)
    if arch == V2:
        fields.update(conv="two_tap", selector="walk")
    else:
        fields.update(conv="none", selector="argmax")
    layer_types = meta.get("layer_types") or []
    if meta.get("sliding_window") and "sliding_attention" in layer_types:
        fields["context_window"] = int(meta["sliding_window"])
    fields["extra"] = {"architecture": arch, "config": meta, "dflash_config": dflash, "top_block_size": top_block}
    return DFlash2Config(**fields)


def reference_from_config(config: DFlash2Config) -> dict[str, Any]:
    """DFlash2Config → reference config.json (v2 when it has the conv, v1 otherwise)."""
    extra = config.extra or {}
    v2 = config.conv == "two_tap"
    if v2 != (config.selector != "argmax"):
        raise ValueError("the reference format has DFlash 1 (no conv, argmax) and DFlash 2 (conv, selector) only; "
                         f"conv={config.conv!r} with selector={config.selector!r} has no reference form")
    meta: dict[str, Any] = {"architectures": [V2 if v2 else V1], "model_type": "qwen3"}
    meta.update(extra.get("config", {}))
    meta.update({theirs: getattr(config, ours) for theirs, ours in SIZES.items()})
    meta["rope_theta"] = config.rope_theta
    meta["num_target_layers"] = config.num_target_layers
    if extra.get("top_block_size", config.block_size) is not None:  # kept unless the imported file lacked it
        meta["block_size"] = config.block_size
    dflash = dict(extra.get("dflash_config", {}))
    dflash.update(mask_token_id=config.mask_token_id, target_layer_ids=list(config.target_layer_ids),
                  block_size=config.block_size)
    if v2:
        dflash.update(conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
                      selector_rank=config.selector_rank, selector_top_k=config.selector_top_k)
    for name in OPTIONS:
        if getattr(config, name) is not None:
            dflash[name] = getattr(config, name)
    meta["dflash_config"] = dflash
    if config.context_window is not None:
        meta["sliding_window"] = config.context_window
        meta["layer_types"] = ["sliding_attention"] * config.num_layers
    return {k: v for k, v in meta.items() if v is not None}


def state_from_reference(tensors: dict[str, Tensor], expected: dict[str, Tensor]) -> tuple[dict[str, Tensor], bool]:
    """Reference tensors → our state dict; strict. Returns (state, codebooks had a .weight suffix)."""
    state, suffix = {}, False
    for name, tensor in tensors.items():
        ours = name if name.startswith("candidate_selector.") else PREFIX + name
        if name.endswith(".weight") and name[: -len(".weight")] in CODEBOOKS:
            ours, suffix = name[: -len(".weight")], True
        state[ours] = tensor
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        unexpected = [k[len(PREFIX):] if k.startswith(PREFIX) else k for k in unexpected]
        raise ValueError(f"reference checkpoint does not fit the config: missing {missing}, unused {unexpected}")
    wrong = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        raise ValueError(f"reference tensors with wrong shapes (file vs config): {wrong}")
    return state, suffix


def reference_from_state(state: dict[str, Tensor], codebook_suffix: bool) -> dict[str, Tensor]:
    out = {}
    for name, tensor in state.items():
        if name in CODEBOOKS:
            out[name + (".weight" if codebook_suffix else "")] = tensor
        else:
            out[name[len(PREFIX):] if name.startswith(PREFIX) else name] = tensor
    return out
