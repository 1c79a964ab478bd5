"""Typed configuration of a DFlash / DFlash-2 drafter.

One flat dataclass: every ablation is a diff of these fields (`conv="none", selector="argmax"` is
DFlash-1; `block_size=1` is plain autoregressive decoding through the same loop). Sizes that must
equal the target's (hidden size, vocabulary) are filled in by `DFlash2Drafter.from_target`.

Dimension letters used across the package: N batch, T positions, B block size, L = B - 1 draft
positions, C context positions, H hidden size, V vocabulary, K candidates per position, r selector
rank, F = len(target_layer_ids) * H fused target feature width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

CONV_KINDS = ("two_tap", "none")
SELECTOR_KINDS = ("walk", "viterbi", "argmax")


@dataclass
class DFlash2Config:
    # -- sizes shared with the target ------------------------------------------------------------
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    # -- drafter backbone (Qwen3-style layers) ---------------------------------------------------
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    intermediate_size: int | None = None  # None: 3 * hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    num_layers: int = 1
    # -- block diffusion -------------------------------------------------------------------------
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()  # empty: default_target_layer_ids(num_target_layers)
    context_window: int | None = None  # attend to the last W context positions only (W >= block_size)
    draft_len: int | None = None  # propose only the first draft_len of the B - 1 drafted positions (None: all);
    #                               the drafter still runs the whole block, the target verifies fewer tokens
    # -- two-tap dynamic convolution (DFlash 2) --------------------------------------------------
    conv: str = "two_tap"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    # -- candidate heads and path selector (DFlash 2) --------------------------------------------
    selector: str = "walk"
    selector_top_k: int = 16
    selector_rank: int = 256
    # -- draft vocabulary (FR-Spec style) --------------------------------------------------------
    draft_vocab_size: int | None = None  # the LM head drafts among this many token ids only (the drafter's
    #                                     `draft_vocab` buffer, e.g. a corpus's most frequent tokens); the
    #                                     target still verifies over the whole vocabulary, so nothing is lost
    # -- options of the reference checkpoint format ----------------------------------------------
    input_embedding_scale: float | None = None  # block embeddings × scale
    output_multiplier: float | None = None  # draft logits × multiplier
    final_logit_softcapping: float | None = None  # draft logits → cap · tanh(logits / cap)
    extra: dict[str, Any] = field(default_factory=dict)  # imported config fields dflash2 does not model

    def __post_init__(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids) or default_target_layer_ids(
            self.num_target_layers
        )
        if self.head_dim is None:
            _check(self.hidden_size % self.num_attention_heads == 0,
                   f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                   f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        self._validate()

    def _validate(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_target_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "num_layers", "block_size",
                     "conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank",
                     "max_position_embeddings"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   f"{name} must be a positive integer, got {value!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
               f"{self.num_key_value_heads}")
        _check(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _check(0 <= self.mask_token_id < self.vocab_size,
               f"mask_token_id {self.mask_token_id} is out of range for vocab_size {self.vocab_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        _check(not bad, f"target_layer_ids {list(bad)} out of range: the target has layers "
                        f"0..{self.num_target_layers - 1}")
        _check(len(set(self.target_layer_ids)) == len(self.target_layer_ids),
               f"target_layer_ids has duplicates: {list(self.target_layer_ids)}")
        _check(self.conv in CONV_KINDS, f"conv must be one of {CONV_KINDS}, got {self.conv!r}")
        if self.conv == "two_tap":
            _check(self.hidden_size % self.conv_group_size == 0,
                   f"hidden_size {self.hidden_size} is not divisible by conv_group_size {self.conv_group_size}")
        _check(self.selector in SELECTOR_KINDS,
               f"selector must be one of {SELECTOR_KINDS}, got {self.selector!r}")
        _check(self.selector_top_k <= self.vocab_size,
               f"selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, (int, float)) and value > 0),
                   f"{name} must be None or a positive number, got {value!r}")
        if self.context_window is not None:
            _check(isinstance(self.context_window, int) and self.context_window >= self.block_size,
                   f"context_window must be None or an integer >= block_size ({self.block_size}), "
                   f"got {self.context_window!r}")
        if self.draft_vocab_size is not None:
            _check(isinstance(self.draft_vocab_size, int) and not isinstance(self.draft_vocab_size, bool)
                   and self.selector_top_k <= self.draft_vocab_size <= self.vocab_size,
                   f"draft_vocab_size must be None or an integer in selector_top_k..vocab_size "
                   f"({self.selector_top_k}..{self.vocab_size}), got {self.draft_vocab_size!r}")
        if self.draft_len is not None:
            _check(isinstance(self.draft_len, int) and not isinstance(self.draft_len, bool) and self.draft_len >= 1,
                   f"draft_len must be None or a positive integer, got {self.draft_len!r}")

    @property
    def num_draft_positions(self) -> int:
        """L = B - 1 (the block's anchor is known, positions 1..B-1 are drafted), or draft_len if set."""
        return self.block_size - 1 if self.draft_len is None else min(self.draft_len, self.block_size - 1)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DFlash2Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, f"unknown DFlash2Config fields: {unknown}")
        return cls(**data)

    def replace(self, **changes: Any) -> "DFlash2Config":
        return dataclasses.replace(self, **changes)


def default_target_layer_ids(num_target_layers: int, num_features: int | None = None) -> tuple[int, ...]:
    """Evenly spaced layer ids from 1 to L-3 (the DFlash default); one id gives L // 2.

    With fewer than 5 target layers the span 1..L-3 is empty, so ids spread over 0..L-1 instead.
    """
    L = num_target_layers
    n = num_features if num_features is not None else min(5, max(1, L - 1))
    if n == 1:
        return (L // 2,)
    lo, hi = (1, L - 3) if L - 3 > 1 else (0, L - 1)
    n = min(n, hi - lo + 1)
    if n == 1:
        return (L // 2,)
    ids = sorted({round(lo + k * (hi - lo) / (n - 1)) for k in range(n)})
    return tuple(ids)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


__all__ = ["DFlash2Config", "default_target_layer_ids", "CONV_KINDS", "SELECTOR_KINDS"]
