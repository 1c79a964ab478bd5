"""The target's decoder step written out, gpt-fast style, for Llama-family targets (StaticTarget's default).

    for each layer:
        q, k, v = split(rms_norm(x) @ Wqkv);  q, k = rope(q, k)      (+ per-head q/k norms: Qwen3)
        K[start:end], V[start:end] = k, v                            the preallocated cache
        x      += attention(q, K[:end], V[:end], mask) @ Wo
        gate, up = split(rms_norm(x) @ Wgu);  x += (silu(gate) * up) @ Wd
    → rms_norm(x)

Four matrix products a layer instead of seven; on CPU the weights are prepacked for oneDNN, and under
gemm="inductor" they stay parameters that inductor freezes. `linear_dtype` runs the products (the LM
head's too) in another dtype, as autocast would; the residual stream, norms, RoPE, attention and cache
keep the model's dtype, and decoding is lossless with respect to that arithmetic. A layer not written
out here is refused with NotImplementedError and the reason (StaticTarget then runs the model's own
layers). The weights are copied at construction: a model whose weights change needs a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.layers import SDPA_GQA

# RoPE types whose tables depend on the sequence length, not only on the position.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})

# Passes of at most this many tokens per row attend by matrix products: one-token passes (plain steps),
# where PyTorch's CPU SDPA kernel, built for blocks of queries, costs more than the arithmetic of one
# query per head. Wider passes (verifications, prefills) use SDPA, which measured as fast or faster
# there (docs/architecture.md, "Performance choices").
PRODUCT_ATTENTION_UP_TO = 1


# oneDNN's linear with a weight prepacked by mkldnn._reorder_linear_weight, as an operator of its own, so
# that a compiled step calls it as it is (`weight`: the plain weight, for the output's shape). Registered
# with torch.library.define/impl rather than torch.library.custom_op: a compiled graph calls the kernel
# directly, without custom_op's per-call wrapper (docs/architecture.md, "Performance choices").
torch.library.define("dflash2::packed_linear", "(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.impl("dflash2::packed_linear", "CompositeExplicitAutograd")
def packed_linear(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.register_fake("dflash2::packed_linear")
def _(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class Linear:
    """y = x Wᵀ + b, its product in `dtype` (default: the weight's): W (and b) stored in it; an input of
    another dtype is cast to it and the output cast back to the input's dtype, as autocast runs a
    linear. CPU float32/bfloat16: W prepacked once for oneDNN; elsewhere F.linear."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype or weight.dtype
        # parameters: a graph compiled with inductor's freezing takes them as constants (`in_graph`)
        self.weight = nn.Parameter(weight.detach().to(self.dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(self.dtype), requires_grad=False)
        self.in_graph = "aten"  # how a compiled graph multiplies: "aten" (the packed call), "inductor" (its own)
        self.packed = None
        if weight.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and _onednn():
            # oneDNN picks its weight layout from the expected rows per call; measured choices
            hint = 1 if self.dtype == torch.bfloat16 else None
            args = (self.weight,) if hint is None else (self.weight, hint)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(*args)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype != self.dtype:
            return self._product(x.to(self.dtype)).to(x.dtype)
        return self._product(x)

    def _product(self, x: Tensor) -> Tensor:
        if self.in_graph == "inductor" and torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)  # a product inductor writes itself (StaticTarget's gemm)
        if self.packed is not None:
            if torch.compiler.is_compiling():
                return torch.ops.dflash2.packed_linear(x, self.packed, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class Layer:
    ln_attn: Tensor  # [H] input_layernorm weight
    qkv: Linear  # H → (nq + 2 nkv) hd
    qk_norm: Tensor | None  # [nq + nkv, hd]: q_norm's weight on the q heads, k_norm's on the k heads
    o: Linear  # nq hd → H
    ln_mlp: Tensor  # [H] post_attention_layernorm weight
    gate_up: Linear  # H → 2 I
    down: Linear  # I → H
    kind: str  # the layer's attention kind (its mask)


def _onednn() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cat(*ts: Tensor | None) -> Tensor | None:
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise ValueError("some projections have a bias and some not")
    return torch.cat(ts)  # type: ignore[arg-type]


def fusable(model: nn.Module) -> str | None:
    """None when every layer of the (Llama-family) model is one this module writes out, else why not."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the written-out MLP is SiLU-gated)"
    rope = getattr(decoder, "rotary_emb", None)
    if rope is None or getattr(rope, "rope_type", "default") in LENGTH_DEPENDENT_ROPE:
        return f"RoPE type {getattr(rope, 'rope_type', None)!r} depends on the sequence length"
    norms = [decoder.norm] + [m for layer in decoder.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not all(type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") for m in norms):
        return "a norm other than RMSNorm"
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names):
            return "attention without q/k/v/o linear projections"
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP without gate/up/down projections"
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            return "a q norm without a k norm"
    return None


class FusedDecoder:
    """The model's decoder as written-out weights and one step function (module docstring)."""

    def __init__(self, model: nn.Module, layer_kinds: list[str], keep: tuple[int, ...] = (),
                 linear_dtype: torch.dtype | None = None) -> None:
        why = fusable(model)
        if why is not None:
            raise NotImplementedError(f"the fused step does not run this model: {why}")
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.embed = decoder.embed_tokens.weight.detach()
        self.eps = float(decoder.norm.variance_epsilon)
        self.norm = decoder.norm.weight.detach()
        attn0 = decoder.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.n_q = attn0.q_proj.out_features // self.head_dim
        self.n_kv = attn0.k_proj.out_features // self.head_dim
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.product_attention_up_to = PRODUCT_ATTENTION_UP_TO  # passes of at most this many tokens (_attention)
        self.linear_dtype = linear_dtype  # the matrix products' dtype (None: the weights')
        self.layers = [self._layer(layer, kind) for layer, kind in zip(decoder.layers, layer_kinds)]
        self.keep = tuple(keep)  # the layers whose hidden states a pass returns, in this order
        self.kept_after = [i in self.keep for i in range(len(self.layers))]
        self.rotary = decoder.rotary_emb
        cos, _ = self.rotary(self.embed[:1][None], torch.zeros(1, 1, dtype=torch.long, device=self.embed.device))
        if cos.shape[-1] != self.head_dim:
            raise NotImplementedError(f"partial rotary ({cos.shape[-1]} of {self.head_dim} dims) is not written out")

    def _layer(self, layer: nn.Module, kind: str) -> Layer:
        a, m = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if float(norm.variance_epsilon) != self.eps:
                raise NotImplementedError("layers with different RMSNorm epsilons are not written out")
        qk_norm = None
        if getattr(a, "q_norm", None) is not None:
            if float(a.q_norm.variance_epsilon) != self.eps or float(a.k_norm.variance_epsilon) != self.eps:
                raise NotImplementedError("q/k norms with their own epsilon are not written out")
            qk_norm = torch.cat([a.q_norm.weight.detach().expand(self.n_q, -1),
                                 a.k_norm.weight.detach().expand(self.n_kv, -1)])
        w = lambda *ps: torch.cat([p.weight.detach() for p in ps]).contiguous()  # noqa: E731
        lin = lambda weight, bias: Linear(weight, bias, self.linear_dtype)  # noqa: E731
        return Layer(
            ln_attn=layer.input_layernorm.weight.detach(),
            qkv=lin(w(a.q_proj, a.k_proj, a.v_proj), _cat(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)),
            qk_norm=qk_norm,
            o=lin(a.o_proj.weight.detach(), a.o_proj.bias),
            ln_mlp=layer.post_attention_layernorm.weight.detach(),
            gate_up=lin(w(m.gate_proj, m.up_proj), _cat(m.gate_proj.bias, m.up_proj.bias)),
            down=lin(m.down_proj.weight.detach(), m.down_proj.bias),
            kind=kind)

    def linears(self) -> list[Linear]:
        """Every layer's matrix products."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def step(self, ids: Tensor, positions: Tensor, masks: dict[str, Tensor | None], keys: list[Tensor],
             values: list[Tensor], start: int) -> tuple[Tensor, list[Tensor]]:
        """ids [R, T] at `positions` [R, T]; K/V written to slots start..start+T of keys/values
        ([R, n_kv, capacity, hd] per layer); masks: additive [1 or R, 1, T, start+T] per layer kind,
        or None (a query that sees every key). → final-normed hidden states [R, T, H], and the hidden
        states after each layer of `self.keep`, in its order (the last layer's: the normed one, as HF
        reports it)."""
        R, T = ids.shape
        end = start + T
        hd, nq, nkv, eps = self.head_dim, self.n_q, self.n_kv, self.eps
        x = F.embedding(ids, self.embed)  # [R, T, H]
        # the model's rotary module, per pass as its forward calls it (its float32 cos/sin of a position are
        # not the same to the last bit in every pass shape); rotate_half(x) * sin = roll(x, hd/2) * signed sin
        cos, sin = self.rotary(x, positions)  # [R, T, hd]
        cos, sin = cos[:, :, None], torch.cat([-sin[:, :, None, : hd // 2], sin[:, :, None, hd // 2:]], dim=-1)  # [R, T, 1, hd]
        kept: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln_attn, eps)
            qkv = layer.qkv(h)  # [R, T, (nq + 2 nkv) hd]
            qk = qkv[..., : (nq + nkv) * hd].view(R, T, nq + nkv, hd)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, eps)
            qk = qk * cos + qk.roll(hd // 2, dims=-1) * sin
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)  # [R, heads, T, hd]
            keys[i][:, :, start:end] = k
            values[i][:, :, start:end] = qkv[..., (nq + nkv) * hd:].view(R, T, nkv, hd).transpose(1, 2)
            o = _attention(q, keys[i][:, :, :end], values[i][:, :, :end], masks[layer.kind], self.scaling,
                           products=T <= self.product_attention_up_to)
            x = x + layer.o(o.transpose(1, 2).reshape(R, T, nq * hd))
            gate, up = layer.gate_up(_rms_norm(x, layer.ln_mlp, eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if self.kept_after[i]:
                kept[i] = x
        normed = _rms_norm(x, self.norm, eps)
        kept[len(self.layers) - 1] = normed
        return normed, [kept[i] for i in self.keep]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The models' RMSNorm: normalized in float32 (whatever x's dtype, float64 included), cast back,
    then scaled: weight * (x / rms(x)).to(x.dtype). In float32 one fused call gives the same bits."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, products: bool = False) -> Tensor:
    """q [R, nq, T, hd], k/v [R, nkv, S, hd] (grouped heads), mask additive [1 or R, 1, T, S] or None →
    [R, nq, T, hd]. `products`: as two batched matrix products and a softmax, each K/V head's group of
    query heads as one matrix (no copy of K/V per query head); else by PyTorch's SDPA."""
    if products:
        R, nq, T, hd = q.shape
        nkv, S = k.shape[1], k.shape[2]
        g = nq // nkv
        scores = q.reshape(R, nkv, g * T, hd) @ k.transpose(-1, -2) * scale  # [R, nkv, g T, S]
        if mask is not None:
            scores = (scores.view(R, nkv, g, T, S) + mask[:, :, None]).view(R, nkv, g * T, S)
        return (scores.softmax(-1) @ v).view(R, nq, T, hd)
    if SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


__all__ = ["FusedDecoder", "Linear", "fusable"]
