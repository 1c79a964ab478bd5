"""The published format's RoPE fields and the Qwen3 defaults its configs leave out (reference_format)."""

from __future__ import annotations

import functools
from typing import Any


def rope_from_reference(meta: dict[str, Any]) -> dict[str, Any]:
    """Pop the RoPE fields (transformers 5 `rope_parameters`, or `rope_theta` + `rope_scaling`, and a
    top-level `partial_rotary_factor`) → one rope_parameters dict, as transformers standardises them."""
    params = dict(meta.pop("rope_parameters", None) or meta.pop("rope_scaling", None) or {})
    meta.pop("rope_scaling", None)
    theta = meta.pop("rope_theta", None)
    partial = meta.pop("partial_rotary_factor", None)
    params["rope_type"] = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.setdefault("rope_theta", float(theta if theta is not None else qwen3_defaults_theta()))
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return params


def rope_to_reference(params: dict[str, Any], present: set[str]) -> dict[str, Any]:
    """rope_parameters → the fields of the imported file's format (rope_parameters for a new export)."""
    params = dict(params)
    out: dict[str, Any] = {}
    if "partial_rotary_factor" in present and "partial_rotary_factor" in params:
        out["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if "rope_parameters" in present or not present & {"rope_theta", "rope_scaling"}:
        out["rope_parameters"] = params
        if "rope_theta" in present:
            out["rope_theta"] = params["rope_theta"]
        return out
    out["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default" or len(params) > 1 or "rope_scaling" in present:
        out["rope_scaling"] = params
    return out


@functools.cache
def qwen3_defaults():
    from transformers import Qwen3Config

    return Qwen3Config()


def qwen3_defaults_theta() -> float:
    params = getattr(qwen3_defaults(), "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(qwen3_defaults(), "rope_theta", 10000.0)))
