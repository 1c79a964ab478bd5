"""Two-tap dynamic convolution around a sublayer (DFlash 2; docs/architecture.md, "Data flow of one round").

For block positions i (length B), hidden H, channel groups of size g:

    out[i, c] = Σ_{t < taps} (base[t, c] + δ[i, t, c // g]) · x[i - t, c],   x[-1] = 0

so position i sees its left neighbour(s) and nothing crosses the block start. δ is predicted per
position from the sublayer's (normed) input by one linear map H → 2·taps·(H/g): one half gives the
kernel of the conv *before* the sublayer, the other the conv *after* it. Identity at init (tap 0 = 1,
other taps 0, δ map zero), so a DFlash-1 checkpoint warm-starts a DFlash-2 run exactly.

Both are registered (`dflash2.registry`: `conv: two_tap` / `conv: none`); a convolution of your own is
`register_conv(name, factory)`, with `factory(config)` an nn.Module of this `forward(h, sublayer, rows)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.registry import register_conv

Sublayer = Callable[[Tensor], Tensor]


class TwoTapDynamicConv(nn.Module):
    """conv_post(sublayer(conv_pre(h))) with kernels predicted from h.

    h: [N, T, H] with T a multiple of block_size (several blocks side by side are convolved
    independently). Returns [N, T, H].
    """

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int = 2, group_size: int = 16) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by conv_group_size {group_size}")
        self.block_size, self.taps, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)  # [2 (pre, post), taps, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def kernels(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h [N, T, H] → (pre, post) kernels, each [N, T, taps, H]."""
        N, T, _ = h.shape
        delta = self.kernel_projection(h).view(N, T, 2, self.taps, self.num_groups, 1)  # one δ per channel group
        base = self.base_kernel.to(h.dtype).view(2, self.taps, self.num_groups, self.group_size)
        if h.dtype in (torch.bfloat16, torch.float16):  # CPU half-precision adds are faster without the broadcast
            delta = delta.expand(N, T, 2, self.taps, self.num_groups, self.group_size).contiguous()
        kernel = (base + delta).view(N, T, 2, self.taps, -1)  # [N, T, 2, taps, H]
        return kernel[:, :, 0], kernel[:, :, 1]

    def convolve(self, x: Tensor, kernel: Tensor) -> Tensor:
        """x [N, T, H], kernel [N, T, taps, H] → [N, T, H], causal inside each block. T < block_size
        is the first T positions of one block."""
        N, T, H = x.shape
        B = min(self.block_size, T)
        if T % B:
            raise ValueError(f"sequence length {T} is not a multiple of block_size {B}")
        blocks = x.reshape(N, T // B, B, H)  # [N, nb, B, H]
        out = kernel[:, :, 0] * x
        for t in range(1, self.taps):
            shifted = F.pad(blocks, (0, 0, t, 0))[:, :, :B]  # x[i - t], zeros before the block start
            out = out + kernel[:, :, t] * shifted.reshape(N, T, H)
        return out

    def forward(self, h: Tensor, sublayer: Sublayer, rows: int | None = None) -> Tensor:
        """rows: the sublayer returns only the first `rows` positions (of a single block); so does this."""
        pre, post = self.kernels(h)
        return self.convolve(sublayer(self.convolve(h, pre)), post[:, :rows])


class NoConv(nn.Module):
    """The DFlash-1 baseline: the sublayer alone."""

    def forward(self, h: Tensor, sublayer: Sublayer, rows: int | None = None) -> Tensor:
        return sublayer(h)


register_conv("two_tap", lambda config: TwoTapDynamicConv(config.hidden_size, config.block_size, config.conv_kernel_size,
                                                          config.conv_group_size))
register_conv("none", lambda config: NoConv())
