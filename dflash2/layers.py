"""Small building blocks of the drafter: RMSNorm, rotary embeddings, SwiGLU MLP, attention kernel.

Qwen3 conventions (pre-norm, per-head q/k RMSNorm, rotate-half RoPE) so that drafters trained here
map one-to-one onto the published checkpoint format.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim; statistics in float32 (float64 stays float64)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64) and x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one kernel, the same formula
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); [..., H] → [..., H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding:
    """RoPE tables from transformers' RoPE parameters (`rope_type` default, linear, dynamic, yarn,
    llama3, longrope; `partial_rotary_factor`): the inverse frequencies and the cos/sin scaling come
    from transformers' own RoPE initialisation functions, as the published drafters' Qwen3 rotary
    embedding computes them. The default type is computed here in float64.

    `dynamic` and `longrope` depend on the sequence length: they are evaluated per call at the
    largest position in it plus one, as transformers' dynamic update does on a growing sequence.
    """

    def __init__(self, head_dim: int, rope_parameters: dict, max_position_embeddings: int,
                 hidden_size: int, num_heads: int) -> None:
        self.params = dict(rope_parameters)
        self.type = self.params.get("rope_type", "default")
        self.rotary_dim = int(head_dim * self.params.get("partial_rotary_factor", 1.0))
        self.by_length = self.type in ("dynamic", "longrope")
        self._sizes = (head_dim, max_position_embeddings, hidden_size, num_heads)
        self._fixed: dict[torch.device, tuple[Tensor, float]] = {}

    def inverse_frequencies(self, device: torch.device, seq_len: int | None = None) -> tuple[Tensor, float]:
        """→ inv_freq [rotary_dim / 2] (float64) and the cos/sin scaling factor; computed once per
        device unless the type depends on the sequence length."""
        if not self.by_length and device in self._fixed:
            return self._fixed[device]
        if self.type == "default":
            exponents = torch.arange(0, self.rotary_dim, 2, device=device, dtype=torch.float64) / self.rotary_dim
            self._fixed[device] = (1.0 / self.params["rope_theta"] ** exponents, 1.0)
            return self._fixed[device]
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        head_dim, max_positions, hidden, heads = self._sizes
        config = Qwen3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                             head_dim=head_dim, max_position_embeddings=max_positions,
                             rope_parameters=dict(self.params))
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.type](config, device, seq_len=seq_len)
        out = (inv_freq.to(torch.float64), float(scaling))
        if not self.by_length:
            self._fixed[device] = out
        return out

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [T] or [N, T] (absolute) → cos, sin [T, rd] or [N, 1, T, rd] (broadcast over heads;
        rd the rotated channels)."""
        seq_len = int(positions.max()) + 1 if self.by_length and positions.numel() else None
        inv_freq, scaling = self.inverse_frequencies(positions.device, seq_len)
        angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, rd/2]
        emb = torch.cat([angles, angles], dim=-1)  # [..., T, rd]
        if positions.dim() == 2:
            emb = emb[:, None]
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """x [N, heads, T, hd] rotated by cos/sin [T, rd] or [N, 1, T, rd] over the first rd channels (the
    others pass through, as partial rotary embeddings do). Rotate-half (NeoX) pairs channel i with
    i + rd/2; `interleaved` (GPT-J) pairs 2i with 2i + 1, frequency i (cos/sin hold each frequency twice,
    [angles, angles], so their first half is one per pair)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin, interleaved), x[..., rd:]], dim=-1)
    if interleaved:
        c, s = cos[..., : rd // 2], sin[..., : rd // 2]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None = None) -> Tensor:
    """q [N, h, Tq, d], k/v [N, h_kv, Tk, d], mask bool (True = attend) broadcastable to [N, h, Tq, Tk]
    ([Tq, Tk] or [N, 1, Tq, Tk]) or None → [N, h, Tq, d].

    sinks [h]: one more logit per head in each query's softmax, with no value (attention sinks: the
    softmax over [q·k / √d ..., sink], the sink's share dropped). Written as a key of zeros whose
    additive mask is the sink, so that SDPA computes it exactly.

    Grouped-query heads are expanded here. flash-attn is used when importable, on CUDA, in half
    precision, without a mask or sinks; PyTorch SDPA otherwise.
    """
    if sinks is not None:
        N, h, Tq, _ = q.shape
        bias = (q.new_zeros(Tq, k.shape[2]) if mask is None else
                torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf")))
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(bias.shape[0], h, Tq, k.shape[2])
        sink = sinks.to(q.dtype).view(1, h, 1, 1).expand(bias.shape[0], h, Tq, 1)
        zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
        return _sdpa(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), torch.cat([bias, sink], -1))
    if mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_attn_func()
        if flash is not None:  # flash-attn takes [N, T, h, d] and handles GQA itself
            out = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
            return out.transpose(1, 2)
    return _sdpa(q, k, v, mask)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and SDPA_GQA:  # the kernel reads each K/V head for its group of query heads
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa is new in 2.5


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def as_rows(x: Tensor) -> Tensor:
    """x [..., H] → [n, H] with plain row-major strides. A slice such as hidden[:, 1:] keeps its
    parent's strides, and oneDNN's half-precision matmul runs such 3-d inputs far slower than the
    same rows as a 2-d matrix (docs/architecture.md, "Performance choices"); reshaping copies only
    when the rows are not already evenly spaced."""
    return x.reshape(-1, x.shape[-1])
