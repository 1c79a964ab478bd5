"""Block-diffusion backbone (DFlash).

Qwen3-style pre-norm layers whose attention takes queries from the block only and keys/values from
`[fused target features; block]` (KV injection in every layer). The fused features are the chosen
target layers' hidden states concatenated per position, projected by `fc` and RMS-normed by
`hidden_norm`; each layer turns them into K/V with its own k/v projections, k-norm and RoPE at their
absolute positions. Context entries are only K/V: no MLP, no residual. Each sublayer may be wrapped by
the two-tap dynamic convolution (DFlash 2).

Each layer has the attention layout of the published checkpoints (`config.layer_layout`): full or
sliding, causal or bidirectional inside the block; a sliding window is per query position
(`layout_mask`). The context K/V are computed once per position and kept in a `ContextCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash2.config import DFlash2Config
from dflash2.registry import CONVS
from dflash2.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, attention

Rope = tuple[Tensor, Tensor]  # (cos, sin), each [T, hd] or [N, 1, T, hd]


@dataclass
class ContextCache:
    """Per-layer projected context K/V, each [N, kv_heads, C, hd], and the next absolute position.

    Only the last `config.context_keep` entries are kept when every layer needs no more (sliding
    layers, a run-time context window); `length` still counts every position, so the kept entries
    are positions length - C .. length - 1.
    """

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    length: int = 0


@dataclass
class ContextBatch:
    """The context K/V of R rows drafted together, kept across rounds (batched decoding).

    Per layer one buffer [R, kv_heads, capacity, hd]; row r holds the K/V of its positions
    0 .. lengths[r]-1 in slots 0 .. lengths[r]-1 (position = slot, so nothing moves when a row
    grows); the slots after a row's own are unused. Windows (sliding layers, a context window) mask
    older entries; nothing is dropped. Rows join at the end (`add_rows`) and leave by `select_rows`,
    in step with the target's batch.
    """

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add_rows(self, n: int) -> None:
        """n empty rows join at the end."""
        self.lengths += [0] * n
        grow = lambda t: torch.cat([t, t.new_zeros(n, *t.shape[1:])])  # noqa: E731
        self.keys, self.values = [grow(k) for k in self.keys], [grow(v) for v in self.values]

    def select_rows(self, rows: list[int]) -> None:
        """Keep rows `rows`, in that order (rows that finished leave the batch)."""
        if rows == list(range(len(self.lengths))):
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.lengths = [self.lengths[r] for r in rows]
        self.keys = [k.index_select(0, index.to(k.device)) for k in self.keys]
        self.values = [v.index_select(0, index.to(v.device)) for v in self.values]

    def reserve(self, slots: int) -> None:
        """Make room for `slots` slots per row (grown by at least half, so growth is rare)."""
        if self.keys and self.keys[0].shape[2] < slots:
            more = max(slots, self.keys[0].shape[2] * 3 // 2) - self.keys[0].shape[2]
            grow = lambda t: torch.nn.functional.pad(t, (0, 0, 0, more))  # noqa: E731
            self.keys, self.values = [grow(k) for k in self.keys], [grow(v) for v in self.values]


def layout_mask(query_positions: Tensor, key_positions: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """Which keys each query may see under a layer's layout, from absolute positions.

    query_positions [Tq] or [N, Tq], key_positions [Tk] or [N, Tk] → bool [Tq, Tk] or [N, 1, Tq, Tk]
    (True = attend), or None when the layout restricts nothing (full, bidirectional)."""
    if not causal and window is None:
        return None
    q, k = query_positions[..., :, None], key_positions[..., None, :]
    visible = k <= q if causal else None
    if window is not None:
        near = q - k < window
        if not causal:
            near = near & (k - q < window)
        visible = near if visible is None else visible & near
    return visible[:, None] if visible.dim() == 3 else visible


def _and(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a & b


class KVInjectionAttention(nn.Module):
    """Queries from the block [N, T, H]; keys/values from [context K/V; block K/V]."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.value_scale, self.interleaved = config.attention_value_scale, config.rope_interleaved
        if config.attention_sink_bias:  # a sink logit per head (published checkpoints ship it)
            self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads))
        else:
            self.attention_sink_bias = None

    def project_kv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        """x [N, T, H], rope (cos, sin) of its positions → k, v [N, kv_heads, T, hd] (k normed, rotated)."""
        return self._project_kv(x, rope)

    def _project_kv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        # forward calls this one: under FSDP `project_kv` is a registered forward method of its own
        # (the context's K/V), whose hooks would reshard the weights in the middle of forward
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(N, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.value_scale is not None:
            v = v * self.value_scale
        return apply_rope(k, *rope, self.interleaved), v

    def forward(self, x: Tensor, rope: Rope, context_k: Tensor, context_v: Tensor,
                mask: Tensor | None = None, rows: int | None = None) -> Tensor:
        """x [N, T, H] with rope (cos, sin) of its positions; context_k/v [N, kv_heads, C, hd];
        mask [T, C+T] or [N, 1, T, C+T] (True = attend) or None (everything visible).
        rows: queries from the first `rows` positions only (keys and values from all T) → [N, rows, H]."""
        N, T, _ = x.shape
        Q = T if rows is None else rows
        cos, sin = rope
        q = self.q_norm(self.q_proj(x[:, :Q]).view(N, Q, self.num_heads, self.head_dim)).transpose(1, 2)  # (N, h, Q, hd)
        q = apply_rope(q, cos[..., :Q, :], sin[..., :Q, :], self.interleaved)
        k, v = self._project_kv(x, rope)
        k = torch.cat([context_k, k], dim=2)  # (N, kv, C+T, hd)
        v = torch.cat([context_v, v], dim=2)
        out = attention(q, k, v, None if mask is None else mask[..., :Q, :], self.attention_sink_bias)  # (N, h, Q, hd)
        return self.o_proj(out.transpose(1, 2).reshape(N, Q, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    """Pre-norm layer: x + conv(attn)(norm(x)), then x + conv(mlp)(norm(x))."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        H = config.hidden_size
        self.self_attn = KVInjectionAttention(config)
        self.mlp = SwiGLU(H, config.intermediate_size)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.attention_conv = CONVS.build(config.conv, config)  # config.conv: two_tap, none, or one registered
        self.mlp_conv = CONVS.build(config.conv, config)

    def forward(self, x: Tensor, rope: Rope, context_k: Tensor, context_v: Tensor,
                mask: Tensor | None = None, rows: int | None = None) -> Tensor:
        """x [N, T, H] → [N, T, H], or [N, rows, H]: the first `rows` positions of a single block
        (the convolution is causal inside the block, so they need no later position but as keys)."""
        attend = lambda h: self.self_attn(h, rope, context_k, context_v, mask, rows)
        x = x[:, :rows] + self.attention_conv(self.input_layernorm(x), attend, rows)
        return x + self.mlp_conv(self.post_attention_layernorm(x), self.mlp)


class BlockDiffusionBackbone(nn.Module):
    """Target features → context K/V; block embeddings + context K/V → block hidden states.

    fuse:            features [N, C, F] (F = config.feature_size: len(target_layer_ids)·H_t) → [N, C, H]
    extend_context:  appends the K/V of new context positions to a ContextCache
    forward:         block embeddings [N, T, H] at positions [T] → normed hidden states [N, T, H]
    """

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        H = config.hidden_size
        self.config = config
        self.fc = nn.Linear(config.feature_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.layouts = config.attention_layout  # (causal, window) per layer
        self.gradient_checkpointing = False  # training: recompute each layer in the backward pass
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_parameters, config.max_position_embeddings,
                                      H, config.num_attention_heads)

    def fuse(self, features: Tensor) -> Tensor:
        return self.hidden_norm(self.fc(features))

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """torch.compile both hot paths of decoding in place: the block pass (`forward`, as
        nn.Module.compile does) and the context projection (`context_kv`). Arguments go to
        torch.compile; `dynamic=True` suits decoding, where the context grows every round."""
        super().compile(*args, **kwargs)
        self.context_kv = torch.compile(self.context_kv, *args, **kwargs)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        """RoPE tables of `positions`, computed once per call and shared by every layer."""
        return self.rotary(positions, dtype)

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """features [N, C, F] at positions [C] → per layer (k, v), each [N, kv_heads, C, hd]."""
        fused = self.fuse(features.to(self.fc.weight.dtype))
        rope = self.rope(positions, fused.dtype)
        return [layer.self_attn.project_kv(fused, rope) for layer in self.layers]

    def extend_context(self, cache: ContextCache, features: Tensor) -> ContextCache:
        """Append features [N, n, F] for positions cache.length .. cache.length+n-1 (in place)."""
        return self.extend_contexts([cache], [features])[0]

    def extend_contexts(self, caches: list[ContextCache], features: list[Tensor]) -> list[ContextCache]:
        """`extend_context` for several single-row caches with one projection over all their new
        positions (features[r] [1, n_r, F]; RoPE is per position, so the rows can be concatenated)."""
        new, sizes = self._project([c.length for c in caches], features)
        window = self.config.context_keep
        for r, cache in enumerate(caches):
            lo, hi = sum(sizes[:r]), sum(sizes[: r + 1])
            ks, vs = [k[:, :, lo:hi] for k, _ in new], [v[:, :, lo:hi] for _, v in new]
            if cache.keys:
                ks = [torch.cat([old, k], dim=2) for old, k in zip(cache.keys, ks)]
                vs = [torch.cat([old, v], dim=2) for old, v in zip(cache.values, vs)]
            if window is not None and ks[0].shape[2] > window:  # (window may be 0: a window of 1 keeps no context)
                drop = ks[0].shape[2] - window
                ks, vs = [k[:, :, drop:] for k in ks], [v[:, :, drop:] for v in vs]
            cache.keys, cache.values = ks, vs
            cache.length += sizes[r]
        return caches

    def extend_batch(self, context: ContextBatch, features: list[Tensor], room: int) -> ContextBatch:
        """Append features[r] [1, n_r, F] to row r of `context` at its next positions (in place), and
        leave at least `room` free slots after the longest row (so that the next rounds rarely
        grow the buffers)."""
        sizes = [f.shape[1] for f in features]
        ends = [n + m for n, m in zip(context.lengths, sizes)]
        new = self._project(context.lengths, features)[0] if sum(sizes) else None  # per layer (k, v) [1, kv, Σn+, hd]
        if new is not None and not context.keys:  # the first features: the buffers take the projections' layout
            shape = lambda t: (len(sizes), t.shape[1], max(ends) + room, t.shape[3])  # noqa: E731
            context.keys, context.values = [k.new_zeros(shape(k)) for k, _ in new], [v.new_zeros(shape(v)) for _, v in new]
        context.reserve(max(ends, default=0) + room)
        if new is not None:
            device = context.keys[0].device
            row = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)  # [Σn]
            slot = torch.cat([torch.arange(n, e) for n, e in zip(context.lengths, ends)]).to(device)  # [Σn]
            for buffers, i in ((context.keys, 0), (context.values, 1)):
                for buffer, kv in zip(buffers, new):
                    buffer[row, :, slot] = kv[i][0, :, : len(slot)].transpose(0, 1)  # [Σn, kv, hd]
        context.lengths = ends
        return context

    def _project(self, starts: list[int], features: list[Tensor]) -> tuple[list[tuple[Tensor, Tensor]], list[int]]:
        """features[r] [1, n_r, F] at positions starts[r].. → per layer (k, v) [1, kv, Σn (+ pad), hd]
        with the rows' entries side by side, and the n_r."""
        sizes = [f.shape[1] for f in features]
        device = features[0].device
        positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, sizes)])
        rows = torch.cat(features, dim=1)  # [1, Σn, F]
        # A half-precision drafter on CPU: zero rows pad the new positions to a multiple of the block size,
        # so the projections see a few fixed shapes (a round adds 1..B positions): oneDNN sets up its
        # half-precision matmul again whenever the shape changes (docs/architecture.md, "Performance
        # choices"). Callers drop the pad rows. Float32 (MKL) has no such cost and is left as is.
        half = self.fc.weight.dtype in (torch.bfloat16, torch.float16) and self.fc.weight.device.type == "cpu"
        pad = -rows.shape[1] % self.config.block_size if half else 0
        if pad:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
            positions = torch.cat([positions, positions[-1] + 1 + torch.arange(pad, device=device)])
        return self.context_kv(rows, positions), sizes

    def forward(self, x: Tensor, positions: Tensor, context: list[tuple[Tensor, Tensor]],
                mask: Tensor | None = None, rows: int | None = None,
                key_positions: Tensor | None = None) -> Tensor:
        """x [N, T, H] block embeddings at positions [T] or [N, T]; context per-layer (k, v)
        [N, kv, C, hd]; mask [T, C+T] or [N, 1, T, C+T] (True = attend) or None → [N, T, H].

        key_positions [C+T] or [N, C+T]: the absolute position of every key (context, then block);
        needed when a layer is causal or sliding, whose masks (`layout_mask`) are and-ed with `mask`.
        rows (a single block, T = block_size): only the first `rows` outputs are wanted → [N, rows, H].
        Every layer but the last still runs all T positions (their outputs are the last layer's keys
        and values); the last runs its queries, MLP and convolutions on `rows` positions only."""
        rope = self.rope(positions, x.dtype)
        if rows is not None and not 0 < rows <= x.shape[1] == self.config.block_size:
            raise ValueError(f"rows must be in 1..{self.config.block_size} for a single block, got {rows}")
        masks: dict[tuple[bool, int | None], Tensor | None] = {}  # one mask per distinct layout
        for layout in self.layouts:
            if layout not in masks:
                if layout != (False, None) and key_positions is None:
                    raise ValueError("causal or sliding layers need key_positions")
                masks[layout] = _and(mask, layout_mask(positions, key_positions, *layout))
        last = len(self.layers) - 1
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, (layer, (k, v), layout) in enumerate(zip(self.layers, context, self.layouts)):
            args = (x, rope, k, v, masks[layout], rows if i == last else None)
            x = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return self.norm(x)
