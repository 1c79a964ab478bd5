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

DSpark (`Qwen3DSparkModel`: vLLM's `qwen3_dspark.py` and its speculator's `_sample_sequential_topk`)
and LiLiCorr (`LiLiCorrDraftModel`: `lilicorr.py`'s LiLiCorrHead.score and the DFlash 2 speculator's
walk, which starts from predecessor index 0 and reads the correlator's scores only) are written from
those files, in their own formulation (the concatenated factor input, a dense -inf buffer for the
corrected DSpark candidates).
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
                top_k=value("selector_top_k"), method=method(cfg),
                v2="DFlash2DraftModel" in cfg["architectures"] or bool(dflash.get("conv_kernel_size")) and
                "LiLiCorrDraftModel" in cfg["architectures"])


def method(cfg: dict) -> str:
    archs = cfg["architectures"]
    if "Qwen3DSparkModel" in archs or "DSparkDraftModel" in archs:
        return "dspark"
    return "lilicorr" if "LiLiCorrDraftModel" in archs else "dflash2" if "DFlash2DraftModel" in archs else "dflash"


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


def drafts(cfg: dict, t: dict[str, Tensor], hidden: Tensor, head: Tensor, anchor: int,
           embedding: Tensor | None = None, anchor_hidden: Tensor | None = None) -> list[int]:
    """Greedy drafts of block positions 1..B-1: argmax (DFlash), the selector's walk (DFlash 2), the
    Markov head's sequential argmax (DSpark), the walk over LiLiCorr's scores (LiLiCorr: needs the
    target's `embedding` and `anchor_hidden`, the fused feature of the position before the anchor)."""
    r = resolve(cfg)
    logits = hidden[1:] @ head.T * r["multiplier"]
    if r["cap"] is not None:
        logits = torch.tanh(logits / r["cap"]) * r["cap"]
    if r["method"] == "dspark":
        return dspark(cfg, t, hidden, logits, anchor)[0]
    if r["method"] == "lilicorr":
        return lilicorr_walk(cfg, t, logits, hidden[1:], embedding, anchor_hidden)
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


def dspark(cfg: dict, t: dict[str, Tensor], hidden: Tensor, logits: Tensor, anchor: int
           ) -> tuple[list[int], Tensor | None]:
    """DSpark's greedy draft and confidences: the top-k base values once, then left to right the Markov
    bias W2[cand] · W1[prev] added to them in a dense -inf row and its argmax; c_t = sigmoid(proj(
    [h_t ; W1[prev_t]]) or proj(h_t)) over the drafted tokens' predecessors."""
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    values, index = logits.topk(int(cfg["dspark_draft_topk"]), dim=-1)
    path, prev, embeds = [], anchor, []
    for pos in range(logits.shape[0]):
        embed = w1[prev]
        embeds.append(embed)
        row = torch.full_like(logits[pos], float("-inf"))
        row[index[pos]] = values[pos] + w2[index[pos]] @ embed
        prev = int(row.argmax())
        path.append(prev)
    if not cfg.get("enable_confidence_head"):
        return path, None
    x = hidden[1:]
    if cfg.get("confidence_head_with_markov"):
        x = torch.cat([x, torch.stack(embeds)], dim=-1)
    conf = torch.sigmoid(x.float() @ t["confidence_head.proj.weight"].float().T + t["confidence_head.proj.bias"].float())
    return path, conf[:, 0]


def lilicorr_scores(cfg: dict, t: dict[str, Tensor], ids: Tensor, log_probs: Tensor, pass_hidden: Tensor,
                    embedding: Tensor, anchor_hidden: Tensor) -> Tensor:
    """LiLiCorrHead.forward for one row: ids, log_probs [L, K], pass_hidden [L, H] → scores [L, K, K]
    (row 0: the anchor's scores repeated for every predecessor; row s > 0: slot s-1 → slot s)."""
    d = cfg["dflash_config"]
    w = lambda name: t["lilicorr." + name]  # noqa: E731
    lin = lambda x, name: x @ w(name + ".weight").T + w(name + ".bias")  # noqa: E731
    L, K = ids.shape
    H = cfg["hidden_size"]
    h = d["lilicorr_hidden_size"] or H
    heads, eps, B = d["lilicorr_num_heads"], cfg["rms_norm_eps"], int(d.get("block_size", cfg.get("block_size")))
    tok = embedding[ids]
    x = tok if h == H else lin(tok, "token_proj")
    x = x + lin(pass_hidden, "pass_hidden_proj")[:, None, :]
    lp = log_probs
    rank = torch.arange(K, dtype=lp.dtype) / (K - 1) if K > 1 else torch.zeros(K, dtype=lp.dtype)
    f = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand(L, K),
                     (torch.arange(K) == 0).to(lp.dtype).expand(L, K)], dim=-1)
    f = F.layer_norm(f, (5,), w("feature_norm.weight"), w("feature_norm.bias"))
    x = x + lin(F.silu(lin(f, "feature_mlp.up_proj")), "feature_mlp.down_proj")
    x = x + w("slot_embedding")[0, 0, :L] + w("rank_embedding")[0, 0]
    x = x.reshape(L * K, h)
    slot = torch.arange(L).repeat_interleave(K)
    rel = slot[:, None] - slot[None, :]
    bias = w("relative_slot_bias")[:, rel + B - 1] + (rel == 0).to(x.dtype) * w("same_slot_bias")[:, None, None]
    hd = h // heads
    for i in range(d["lilicorr_num_layers"]):
        p = f"layers.{i}."
        y = rms(x, w(p + "attn_norm.weight"), eps)
        q, k, v = (y @ w(p + "attn.in_proj_weight").T + w(p + "attn.in_proj_bias")).chunk(3, dim=-1)
        q, k, v = (z.reshape(L * K, heads, hd).transpose(0, 1) for z in (q, k, v))
        att = ((q @ k.transpose(1, 2)) * hd ** -0.5 + bias).softmax(-1) @ v
        x = x + lin(att.transpose(0, 1).reshape(L * K, h), p + "attn.out_proj")
        y = rms(x, w(p + "mlp_norm.weight"), eps)
        x = x + lin(F.silu(lin(y, p + "mlp.up_proj")), p + "mlp.down_proj")
    x = rms(x, w("output_norm.weight"), eps).reshape(L, K, h)
    a = rms(lin(anchor_hidden, "context_proj"), w("anchor_norm.weight"), eps)
    factor = F.silu(lin(torch.cat([x, a.expand(L, K, h), x * a], dim=-1), "factor_input_proj"))
    unit = lambda z: z / z.norm(dim=-1, keepdim=True).clamp_min(d["lilicorr_vector_eps"])  # noqa: E731
    out_vec, in_vec = unit(lin(factor, "out_head")), unit(lin(factor, "in_head"))
    anchor_out = unit(lin(a, "anchor_out_head"))
    start = in_vec[0] @ anchor_out  # [K]
    pairs = out_vec[:-1] @ in_vec[1:].transpose(-1, -2)  # [L-1, K, K]
    scale = d["lilicorr_logit_scale"]  # vLLM's forward: logit_scale × the scores cast to float32
    return torch.cat([(scale * start.float()).expand(1, K, K), scale * pairs.float()])


def lilicorr_candidates(cfg: dict, logits: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's get_top_k_tokens(return_log_probs=True): the top-k ids and their log-probabilities, the
    top-k values and the log-partition both in float32 (then back to the hidden states' dtype)."""
    values, ids = logits.topk(cfg["dflash_config"]["lilicorr_candidate_topk"], dim=-1)
    log_probs = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return ids, log_probs.to(logits.dtype)


def lilicorr_walk(cfg: dict, t: dict[str, Tensor], logits: Tensor, pass_hidden: Tensor, embedding: Tensor,
                  anchor_hidden: Tensor) -> list[int]:
    """The greedy walk of vLLM's DFlash 2 speculator over LiLiCorr's scores: previous = 0 at the start."""
    ids, log_probs = lilicorr_candidates(cfg, logits)
    scores = lilicorr_scores(cfg, t, ids, log_probs, pass_hidden, embedding, anchor_hidden)
    path, previous = [], 0
    for step in range(ids.shape[0]):
        previous = int(scores[step, previous].argmax())
        path.append(int(ids[step, previous]))
    return path
