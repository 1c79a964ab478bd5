"""Typed configuration of a DFlash / DFlash-2 drafter.

One flat dataclass: every ablation is a diff of these fields (`conv="none", selector="argmax"` is
DFlash-1; `block_size=1` is plain autoregressive decoding through the same loop). Sizes that must
equal the target's (hidden size, vocabulary) are filled in by `DFlash2Drafter.from_target`.

Dimension letters used across the package: N batch, T positions, B block size, L = B - 1 draft
positions, C context positions, H hidden size, V vocabulary, K candidates per position, r selector
rank, F = len(target_layer_ids) * H_t fused target feature width (H_t: the target's hidden size,
`target_hidden_size`, which equals H unless the drafter has its own embedding and LM head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

CONV_KINDS = ("two_tap", "none")  # the built-in ones; dflash2.register_conv adds more
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
SELECTOR_KINDS = ("walk", "viterbi", "argmax", "dspark", "lilicorr")  # the built-in ones; dflash2.register_selector adds more


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
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    #                                 transformers' RoPE parameters: rope_type (default, linear, dynamic, yarn, llama3,
    #                                 longrope, ...), rope_theta, the type's own keys, partial_rotary_factor
    max_position_embeddings: int = 32768
    num_layers: int = 1
    # -- attention layout (the published checkpoints' fields) ------------------------------------
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"; empty: all full
    sliding_window: int | None = None  # W of the sliding layers: the query at position p sees the key at k only
    #                                    if p - k < W (and k - p < W in a non-causal layer); None: no window
    is_causal: bool | None = None  # True: block position i sees block positions <= i (and the context);
    #                                None: sliding layers causal, full layers bidirectional
    attention_value_scale: float | None = None  # values (context and block) × this before attention (vLLM's
    #                                          dflash_config.attention_value_scale); None: × 1
    attention_sink_bias: bool = False  # a learned sink logit per head in every layer's softmax, which takes
    #                                    probability and gives no value (dflash_config.attention_sink_bias)
    rope_interleaved: bool = False  # RoPE on adjacent channel pairs (GPT-J style: the published is_neox_style:
    #                                 false) instead of rotate-half (NeoX style, the default)
    # -- block diffusion -------------------------------------------------------------------------
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()  # empty: default_target_layer_ids(num_target_layers)
    context_window: int | None = None  # run-time draft window: every query sees the last W context positions
    #                                    only (W >= block_size); the engines' --speculative-draft-window-size
    draft_len: int | None = None  # propose only the first draft_len of the B - 1 drafted positions (None: all);
    #                               the drafter still runs the whole block, the target verifies fewer tokens
    # -- two-tap dynamic convolution (DFlash 2) --------------------------------------------------
    conv: str = "two_tap"  # two_tap, none (DFlash-1), or a name given to dflash2.register_conv / "module:Name"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    # -- candidate heads and path selector (DFlash 2) --------------------------------------------
    selector: str = "walk"  # walk, viterbi, argmax, or a name given to dflash2.register_selector / "module:Name"
    selector_top_k: int = 16
    selector_rank: int = 256  # r of the codebooks; DSpark's markov_rank
    # -- DSpark (selector: dspark): a Markov head over the candidates, and a confidence head -----
    confidence_head: bool = False  # c_t = P(token t accepted | the tokens before it were), in Draft.confidence
    confidence_with_markov: bool = False  # the head also reads the Markov embedding of the token before t
    # -- LiLiCorr (selector: lilicorr): a transformer over the B×K lattice (its published keys) ---
    lilicorr_hidden_size: int | None = None  # width of the lattice transformer (None: hidden_size)
    lilicorr_num_layers: int = 2
    lilicorr_num_heads: int = 4
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_factor_dim: int = 64  # width of the outgoing / incoming unit vectors
    lilicorr_vector_eps: float = 1e-6
    lilicorr_logit_scale: float = 10.0  # λ: transition scores are λ × cosine
    # -- a drafter narrower or wider than its target (the published target_hidden_size) ----------
    target_hidden_size: int | None = None  # H_t of the target features the drafter reads (None: hidden_size)
    own_embedding: bool = False  # the drafter embeds its block with its own [V, H] matrix (the checkpoint's
    #                              embed_tokens), not the target's; needed when target_hidden_size != hidden_size
    own_lm_head: bool = False  # the drafter's logits come from its own [V, H] head (lm_head), not the target's
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
        self.layer_types = tuple(self.layer_types)
        if isinstance(self.rope_parameters, dict):
            self.rope_parameters = {"rope_type": "default", **self.rope_parameters}
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
        from dflash2.registry import CONVS, SELECTORS  # built-in or registered names (ValueError naming the known ones)

        CONVS.factory(self.conv)
        if self.conv == "two_tap":
            _check(self.hidden_size % self.conv_group_size == 0,
                   f"hidden_size {self.hidden_size} is not divisible by conv_group_size {self.conv_group_size}")
        SELECTORS.factory(self.selector)
        _check(self.selector_top_k <= self.vocab_size,
               f"selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")
        for name in ("confidence_head", "confidence_with_markov"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        _check(not self.confidence_head or self.selector == "dspark",
               f"confidence_head is DSpark's (selector: dspark), not {self.selector!r}'s")
        _check(not self.confidence_with_markov or self.confidence_head, "confidence_with_markov needs confidence_head: true")
        if self.selector == "lilicorr":
            K, width = self.selector_top_k, self.lilicorr_hidden_size or self.hidden_size
            _check(K <= 16 and K & (K - 1) == 0, f"LiLiCorr's selector_top_k must be a power of two <= 16 (as vLLM "
                                                 f"requires), got {K}")
            for name in ("lilicorr_num_layers", "lilicorr_num_heads", "lilicorr_factor_dim"):
                value = getattr(self, name)
                _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                       f"{name} must be a positive integer, got {value!r}")
            _check(width % self.lilicorr_num_heads == 0,
                   f"LiLiCorr's width {width} is not divisible by lilicorr_num_heads {self.lilicorr_num_heads}")
            for name in ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale"):
                value = getattr(self, name)
                _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                       f"{name} must be a positive number, got {value!r}")
            _check(self.draft_vocab_size is None, "LiLiCorr reads the candidates' log-probabilities over the whole "
                                                  "vocabulary: no draft vocabulary (vLLM refuses one too)")
        for name in ("own_embedding", "own_lm_head"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.target_hidden_size is not None:
            _check(isinstance(self.target_hidden_size, int) and not isinstance(self.target_hidden_size, bool)
                   and self.target_hidden_size >= 1,
                   f"target_hidden_size must be None or a positive integer, got {self.target_hidden_size!r}")
            _check(self.target_hidden_size == self.hidden_size or (self.own_embedding and self.own_lm_head),
                   f"target_hidden_size {self.target_hidden_size} != hidden_size {self.hidden_size}: the target's "
                   "embedding and LM head do not fit the drafter's width, so it needs its own (own_embedding: true, "
                   "own_lm_head: true; a published checkpoint ships embed_tokens and lm_head)")
        _check(isinstance(self.attention_sink_bias, bool), f"attention_sink_bias must be true or false, got "
                                                           f"{self.attention_sink_bias!r}")
        _check(isinstance(self.rope_interleaved, bool), f"rope_interleaved must be true or false, got {self.rope_interleaved!r}")
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping", "attention_value_scale"):
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
        _check(not self.layer_types or len(self.layer_types) == self.num_layers,
               f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        _check(not bad, f"layer_types must be among {LAYER_TYPES}, got {bad}")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int) and not isinstance(
            self.sliding_window, bool) and self.sliding_window >= 1),
            f"sliding_window must be None or a positive integer, got {self.sliding_window!r}")
        _check(self.is_causal in (None, True, False), f"is_causal must be None, true or false, got {self.is_causal!r}")
        rope = self.rope_parameters
        _check(isinstance(rope, dict) and isinstance(rope.get("rope_theta"), (int, float))
               and not isinstance(rope.get("rope_theta"), bool) and rope["rope_theta"] > 0,
               f"rope_parameters must be a dict with a positive rope_theta, got {rope!r}")
        _check(rope["rope_type"] in ROPE_TYPES, f"rope_type must be one of {ROPE_TYPES}, got {rope['rope_type']!r}")
        factor = rope.get("partial_rotary_factor", 1.0)
        _check(isinstance(factor, (int, float)) and 0 < factor <= 1 and int(self.head_dim * factor) % 2 == 0,
               f"partial_rotary_factor must be in (0, 1] and leave an even number of rotated channels, got {factor!r}")
        if self.draft_len is not None:
            _check(isinstance(self.draft_len, int) and not isinstance(self.draft_len, bool) and self.draft_len >= 1,
                   f"draft_len must be None or a positive integer, got {self.draft_len!r}")

    @property
    def feature_size(self) -> int:
        """F: the width of the fused target features the drafter's fc reads."""
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @property
    def num_draft_positions(self) -> int:
        """L = B - 1 (the block's anchor is known, positions 1..B-1 are drafted), or draft_len if set."""
        return self.block_size - 1 if self.draft_len is None else min(self.draft_len, self.block_size - 1)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_layout(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of layer i, as the published checkpoints define them: a sliding layer has
        the window `sliding_window`, a full one none; `is_causal` unset means sliding layers are
        causal and full layers bidirectional."""
        sliding = self.layer_type(i) == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if sliding else None)

    @property
    def attention_layout(self) -> tuple[tuple[bool, int | None], ...]:
        """(causal, window) of every layer."""
        return tuple(self.layer_layout(i) for i in range(self.num_layers))

    @property
    def context_keep(self) -> int | None:
        """How many of the latest context positions a single sequence's cache must keep (None: all).
        A sliding layer's earliest query is the block's first position C, which sees context
        positions > C - W: the last W - 1. The run-time context_window keeps the last W."""
        needs = [None if window is None else window - 1 for _, window in self.attention_layout]
        keep = None if None in needs else max(needs)
        if self.context_window is not None:
            keep = self.context_window if keep is None else min(keep, self.context_window)
        return keep

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DFlash2Config":
        data = dict(data)
        if "rope_theta" in data:  # directories written before rope_parameters
            data["rope_parameters"] = {"rope_type": "default", "rope_theta": float(data.pop("rope_theta"))}
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


__all__ = ["DFlash2Config", "default_target_layer_ids", "CONV_KINDS", "SELECTOR_KINDS", "LAYER_TYPES", "ROPE_TYPES"]
