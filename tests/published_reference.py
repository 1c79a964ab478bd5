"""An independent forward of the published DFlash / DFlash 2 drafter semantics, for the parity tests.

Written from the published description (z-lab/dflash `dflash/model.py` as loaded through
transformers' `Qwen3Config`, and the SGLang / vLLM ports), on plain 2-d tensors, reading a
reference-format `config.json` dict and its tensors by their published names. It shares no code
with the dflash2 package: only transformers' RoPE initialisation functions, which the reference
itself calls. Float64 throughout, one sequence, no cache: every call recomputes from scratch.

The fields only vLLM 0.32 reads (`vllm/model_executor/models/qwen3_dflash.py`, read in its wheel) are
computed as its `_resolve_layer_attention`, `_dflash_layer_causal` and DFlashQwen3Attention do:
`dflash_config.use_swa` / `swa_window_size` / `causal` (over the Qwen3Config vLLM builds, whose
`sliding_window` is None without `use_sliding_window`), the per-head attention sinks
(`dflash_config.attention_sink_bias` or top-level `add_swa_attention_sink_bias`; vLLM's `sinks`: one
more logit per head in the softmax, no value), `dflash_config.attention_value_scale` (values × s,
context and block), `is_neox_style: false` (GPT-J rotary on adjacent channel pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def resolve(cfg: dict) -> dict:
    """The published reading of a config: per-layer (causal, window), head_dim, RoPE, options."""
    dflash = cfg.get("dflash_config", {})
    value = lambda name, default=None: dflash.get(name, cfg.get(name, default))  # noqa: E731
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None  # Qwen3Config
    types = cfg.get("layer_types") or ["sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(n)]
    layers = []
    forced = None  # vLLM's use_swa: every layer slides unless layer_types already has sliding ones
    given = cfg.get("layer_types")
    if dflash.get("use_swa") or "swa_window_size" in dflash:
        window = dflash.get("swa_window_size", window)  # vLLM's hf_config is a Qwen3Config: W as resolved above
        if dflash.get("use_swa") and not (given and "sliding_attention" in given):
            forced = True
    for i, t in enumerate(types):
        sliding = forced if forced is not None else t == "sliding_attention"
        if cfg.get("is_causal") is not None:
            causal = bool(cfg["is_causal"])
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = given is not None and given[i] == "sliding_attention" if forced else sliding
        layers.append((causal, window if sliding else None))
    rope = dict(cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)})
    cap = value("final_logit_softcapping")
    sinks = dflash.get("attention_sink_bias", cfg.get("add_swa_attention_sink_bias", False))
    return dict(layers=layers, head_dim=cfg.get("head_dim", 128), rope=rope, sinks=bool(sinks),
                value_scale=dflash.get("attention_value_scale"), neox=cfg.get("is_neox_style", True),
                scale=float(value("input_embedding_scale", 1.0)), multiplier=float(value("output_multiplier", 1.0)),
                cap=float(cap) if cap else None, block=int(value("block_size", 16)), mask=value("mask_token_id"),
                top_k=value("selector_top_k"), v2="DFlash2DraftModel" in cfg["architectures"])


def rope_tables(cfg: dict, r: dict, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, rd] at absolute positions, as the reference's rotary embedding computes them."""
    params, hd = r["rope"], r["head_dim"]
    if params.get("rope_type", "default") == "default":
        rd = int(hd * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        scaling = 1.0
    else:
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = Qwen3Config(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                             head_dim=hd, max_position_embeddings=cfg["max_position_embeddings"],
                             rope_parameters=dict(params))
        seq_len = int(positions.max()) + 1
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", seq_len=seq_len)
        inv_freq = inv_freq.double()
    angles = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate(x: Tensor, cos: Tensor, sin: Tensor, neox: bool = True) -> Tensor:
    """x [heads, T, hd]: rotate-half (NeoX) over the first rd channels, or (GPT-J) each adjacent pair
    (2i, 2i+1) by frequency i; the rest passes through."""
    rd = cos.shape[-1]
    a, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    if neox:
        rotated = a * cos + torch.cat([-a[..., half:], a[..., :half]], dim=-1) * sin
    else:
        rotated = torch.empty_like(a)
        for i in range(half):  # pair by pair, as GPT-J writes it
            c, s = cos[..., i:i + 1], sin[..., i:i + 1]
            x0, x1 = a[..., 2 * i:2 * i + 1], a[..., 2 * i + 1:2 * i + 2]
            rotated[..., 2 * i:2 * i + 1] = x0 * c - x1 * s
            rotated[..., 2 * i + 1:2 * i + 2] = x1 * c + x0 * s
    return torch.cat([rotated, rest], dim=-1)


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def conv(h: Tensor, dynamic: Tensor, base: Tensor, group: int) -> Tensor:
    """h [B, H]; dynamic [B, taps, groups]; base [taps, H]: out[i] = Σ_t (base[t] + δ[i, t]) · h[i - t]."""
    out = torch.zeros_like(h)
    for t in range(base.shape[0]):
        shifted = torch.cat([h.new_zeros(t, h.shape[1]), h[: h.shape[0] - t]])
        out = out + (base[t][None] + dynamic[:, t].repeat_interleave(group, dim=-1)) * shifted
    return out


def visible(q: Tensor, k: Tensor, causal: bool, window: int | None) -> Tensor:
    """[Tq, Tk]: which key positions each query position sees (the reference's `_attention_mask`)."""
    q, k = q[:, None], k[None, :]
    ok = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
    if causal:
        ok &= k <= q
    if window is not None:
        ok &= q - k < window
        if not causal:
            ok &= k - q < window
    return ok


def block_hidden(cfg: dict, t: dict[str, Tensor], embedding: Tensor, features: Tensor, anchor: int) -> Tensor:
    """features [C, F] of context positions 0..C-1; the block [anchor, MASK…] at C.. → hidden [B, H]."""
    r = resolve(cfg)
    C, B, hd, eps = features.shape[0], r["block"], r["head_dim"], cfg["rms_norm_eps"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    group = cfg.get("dflash_config", {}).get("conv_group_size", 16)
    ids = torch.tensor([anchor] + [r["mask"]] * (B - 1))
    x = F.embedding(ids, embedding) * r["scale"]
    fused = rms(features @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    q_pos, k_pos = torch.arange(C, C + B), torch.arange(C + B)
    cos, sin = rope_tables(cfg, r, k_pos)
    for i, (causal, window) in enumerate(r["layers"]):
        p = f"layers.{i}."
        w = lambda name: t[p + name]  # noqa: E731
        h = rms(x, w("input_layernorm.weight"), eps)
        if r["v2"]:
            dyn = (h @ w("attention_conv.kernel_projection.weight").T).view(B, 2, -1, h.shape[1] // group)
            h = conv(h, dyn[:, 0], w("attention_conv.base_kernel")[0], group)
        q = rms((h @ w("self_attn.q_proj.weight").T).view(B, heads, hd), w("self_attn.q_norm.weight"), eps)
        both = torch.cat([fused, h])
        k = rms((both @ w("self_attn.k_proj.weight").T).view(C + B, kv_heads, hd), w("self_attn.k_norm.weight"), eps)
        v = (both @ w("self_attn.v_proj.weight").T).view(C + B, kv_heads, hd)
        if r["value_scale"] is not None:
            v = v * r["value_scale"]
        q = rotate(q.transpose(0, 1), cos[C:], sin[C:], r["neox"])  # [heads, B, hd]
        k = rotate(k.transpose(0, 1), cos, sin, r["neox"]).repeat_interleave(heads // kv_heads, dim=0)
        v = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        scores = (q @ k.transpose(1, 2)) * hd ** -0.5
        scores = scores.masked_fill(~visible(q_pos, k_pos, causal, window), float("-inf"))
        if r["sinks"]:  # [heads, B, C+B] → [heads, B, C+B+1]: the sink takes its share and gives nothing
            sink = w("self_attn.attention_sink_bias")[:, None, None].expand(heads, B, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out = (probs @ v).transpose(0, 1).reshape(B, heads * hd) @ w("self_attn.o_proj.weight").T
        if r["v2"]:
            out = conv(out, dyn[:, 1], w("attention_conv.base_kernel")[1], group)
        x = x + out
        h = rms(x, w("post_attention_layernorm.weight"), eps)
        if r["v2"]:
            dyn = (h @ w("mlp_conv.kernel_projection.weight").T).view(B, 2, -1, h.shape[1] // group)
            h = conv(h, dyn[:, 0], w("mlp_conv.base_kernel")[0], group)
        out = (F.silu(h @ w("mlp.gate_proj.weight").T) * (h @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
        if r["v2"]:
            out = conv(out, dyn[:, 1], w("mlp_conv.base_kernel")[1], group)
        x = x + out
    return rms(x, t["norm.weight"], eps)


def drafts(cfg: dict, t: dict[str, Tensor], hidden: Tensor, head: Tensor, anchor: int) -> list[int]:
    """Greedy drafts of block positions 1..B-1: argmax (DFlash) or the selector's walk (DFlash 2)."""
    r = resolve(cfg)
    logits = hidden[1:] @ head.T * r["multiplier"]
    if r["cap"] is not None:
        logits = torch.tanh(logits / r["cap"]) * r["cap"]
    if not r["v2"]:
        return logits.argmax(-1).tolist()
    codebook = lambda name: t.get(f"candidate_selector.{name}", t.get(f"candidate_selector.{name}.weight"))  # noqa: E731
    unary, candidates = logits.topk(r["top_k"], dim=-1)
    projected = hidden[1:] @ t["candidate_selector.hidden_projection.weight"].T
    path, prev = [], anchor
    for pos in range(logits.shape[0]):
        scores = unary[pos] + (codebook("predecessor_codebook")[prev] * projected[pos]) @ \
            codebook("successor_codebook")[candidates[pos]].T
        prev = int(candidates[pos, scores.argmax()])
        path.append(prev)
    return path
