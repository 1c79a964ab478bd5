"""Grouped-query attention with a custom mask, for the target's tree and batch passes.

transformers' "sdpa" attention hands grouped-query heads to PyTorch's kernel as they are only when
there is no mask or a single query. With a mask and several queries, which is every tree and every
batched pass, it first copies each key/value head out to its group of query heads (`repeat_kv`):
the whole cache, every layer, every pass (what that costs: docs/architecture.md, "Performance
choices"). On CPU, PyTorch's SDPA takes the mask and the grouped heads
together (`enable_gqa`, torch >= 2.5), so the copy is not needed.
On CUDA a mask with `enable_gqa` falls back to the slow math kernel, so CUDA keeps transformers' path.

`masked_gqa(config)` switches the target's attention to this function for one forward pass and
restores what was there. Registration in transformers' attention tables happens on first use,
not at import.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor

from dflash2.layers import SDPA_GQA

NAME = "dflash2_masked_sdpa"


def masked_gqa_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [N, h, T, d], key/value [N, h_kv, S, d],
    attention_mask additive or bool [N, 1, T, S] → ([N, T, h, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    if (plain and attention_mask is not None and query.device.type == "cpu" and SDPA_GQA
            and query.shape[1] != key.shape[1]):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@functools.cache  # once per process, on first use
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, masked_gqa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # masks are built as for "sdpa" (ours come ready-made)


@contextmanager
def masked_gqa(config):
    """Within the block, a target whose (text) `config` uses "sdpa" runs `masked_gqa_attention`;
    any other attention implementation is left alone. The previous setting is restored on exit."""
    old = getattr(config, "_attn_implementation", None)
    if old != "sdpa":
        yield
        return
    _register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = old
