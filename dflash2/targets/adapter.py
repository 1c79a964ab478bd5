"""The one place that talks to a Hugging Face causal LM (the target); every version-specific detail of
transformers' cache API (the cache keyword, cropping, the cache class) lives here.

    cache = adapter.new_cache()
    step  = adapter.forward(ids [1, T], cache)   # logits [1, T, V] ([1, n, V] with keep_logits=n), features [1, T, F]
    adapter.rollback(cache, step, keep)          # keep only the first `keep` of the step's T tokens
    step  = adapter.forward_tree(anchor, tree, cache);  adapter.keep(cache, step, rows)
    step  = adapter.forward_masked(ids [R, W], q_pos, k_pos, allowed, cache)   # batches: custom mask
    adapter.select_rows(cache, rows); adapter.keep_slots(cache, slots); adapter.append_rows(cache, other)

plus `embed` and `lm_logits`, the frozen embedding and LM head the drafter borrows. Attention-only
targets keep every layer's full history in a `DynamicCache`, so rolling back is an exact crop.
Hybrid targets (Gated DeltaNet layers: Qwen3.5, Qwen3-Next) update conv and recurrent states in
place: `forward` snapshots them first and `rollback` after a partial acceptance restores the snapshot
and replays the kept tokens (docs/hybrid-targets.md).
"""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash2.targets.attention import masked_gqa
from dflash2.targets.cache import GrowingLayer
from dflash2.targets.head import TargetHead
from dflash2.decoding.tree import TokenTree

# Layer types that are pure attention: their KV cache can be cropped exactly.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Recurrent layer types rolled back by snapshot and replay.
ROLLBACK_LAYER_TYPES = frozenset({"linear_attention"})
# Recurrent-state families without a `layer_types` field.
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "rwkv", "falcon_mamba", "jamba", "zamba", "zamba2",
                                   "bamba", "falcon_h1", "granitemoehybrid", "lfm2", "nemotron_h", "xlstm"})
# The first transformers release whose hybrid models (Qwen3.5) run with our snapshot/replay rollback:
# 5.3.0 fails inside the model (its cache lacks `has_previous_state`), 5.5.4 and 5.6.2 give wrong greedy
# tokens without an error, 5.7.0 .. 5.24.0 pass tests/targets/test_hybrid_targets.py (docs/compatibility.md).
HYBRID_MIN_TRANSFORMERS = (5, 7)


class TargetStep(NamedTuple):
    """logits [1, T, V]; features [1, T, F] (the chosen layers' hidden states, concatenated) or None;
    input_ids [1, T] and start (cache length before the step) say what the step added; snapshot is
    the cache state before it (hybrid targets only)."""

    logits: Tensor
    features: Tensor | None
    input_ids: Tensor | None = None
    start: int = 0
    snapshot: Any = None


class TargetAdapter(TargetHead):
    """Wraps an HF causal LM for prefill, block verification and cache cropping."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()) -> None:
        config = getattr(model, "config", None)
        if config is None or not callable(getattr(model, "get_input_embeddings", None)):
            raise TypeError(f"target must be a Hugging Face causal LM (PreTrainedModel), got {type(model).__name__}")
        self.model = model
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layer_ids = tuple(layer_ids)
        self.hybrid = _is_hybrid(self.config)
        if self.hybrid and transformers_version() < HYBRID_MIN_TRANSFORMERS:
            need = ".".join(map(str, HYBRID_MIN_TRANSFORMERS))
            raise NotImplementedError(
                f"hybrid targets (linear_attention layers) need transformers >= {need}; this is "
                f"{transformers.__version__}, whose hybrid cache does not survive a rollback (fails or decodes wrong "
                f"tokens). Upgrade: pip install 'transformers>={need}'")
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range: the target has layers 0..{self.num_layers - 1}")
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params  # HF's: only the last n positions through the LM head
        self._head_copies: list[tuple[tuple, tuple[Tensor, Tensor | None]] | None] = [None, None]  # see _head_in

    # -- facts about the target ------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's activations' dtype (its embeddings'): the masks' dtype."""
        return self.model.get_input_embeddings().weight.dtype

    # -- operations ------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        # hybrid layers need their own cache layer types, which only the config says (and their snapshots
        # hold K/V by reference, so those must never be written in place)
        if self.hybrid:
            return DynamicCache(config=self.model.config)
        cache = DynamicCache()
        if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # layers made lazily: append in place
            cache.layer_class_to_replicate = GrowingLayer
        return cache

    @torch.no_grad()
    def forward(self, input_ids: Tensor, cache: DynamicCache, keep_logits: int | None = None) -> TargetStep:
        """Run ids [1, T] after the cached positions; the cache grows by T. keep_logits=n: logits of the
        last n positions only ([1, n, V]; a prefill needs one row, not T × vocabulary)."""
        want = bool(self.layer_ids)
        start = cache.get_seq_length()
        snapshot = _snapshot(cache) if self.hybrid and start > 0 else None
        out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=want,
                         **{self._cache_kw: cache}, **self._logits_kw(keep_logits))
        features = None
        if want:  # hidden_states[i + 1] is the output of layer i
            features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return TargetStep(_last(out.logits, keep_logits), features, input_ids, start, snapshot)

    @torch.no_grad()
    def rollback(self, cache: DynamicCache, step: TargetStep, keep: int) -> None:
        """Keep only the first `keep` tokens that `step` added to the cache."""
        added = step.input_ids.shape[1]
        if keep == added:
            return
        if not self.hybrid:
            self.crop(cache, step.start + keep)
            return
        if step.snapshot is None:
            raise ValueError("cannot roll back a hybrid target's prefill")
        _restore(cache, step.snapshot)
        if keep > 0:
            self.model(input_ids=step.input_ids[:, :keep], use_cache=True, **{self._cache_kw: cache})

    @torch.no_grad()
    def forward_tree(self, anchor: int, tree: TokenTree, cache: DynamicCache) -> TargetStep:
        """Score [anchor, tree nodes] (M+1 tokens) in one pass after the cached positions.

        Node i sits at position start + depth(i) and sees the cache, the anchor and its own ancestors
        (and, on sliding-window layers, only keys within the window of its position). Row 0 of the
        logits follows the anchor, row i+1 follows node i's path.
        """
        if self.hybrid:
            raise NotImplementedError("verify='tree' needs an attention-only target: linear_attention layers keep a "
                                      "single recurrent state, which cannot follow several branches; use verify='path'")
        start = cache.get_seq_length()
        M = tree.tokens.shape[0]
        ids = torch.cat([torch.tensor([anchor]), tree.tokens.cpu()])[None]  # [1, M+1]
        depth, visible = tree.block()  # [M+1], [M+1, M+1]
        q_pos = (start + depth)[None]  # [1, M+1]
        allowed = torch.cat([torch.ones(M + 1, start, dtype=torch.bool), visible], dim=1)[None]  # [1, M+1, start+M+1]
        k_pos = torch.cat([torch.arange(start)[None], q_pos], dim=1)
        return self.forward_masked(ids, q_pos, k_pos, allowed, cache)

    @torch.no_grad()
    def forward_masked(self, ids: Tensor, q_pos: Tensor, k_pos: Tensor, allowed: Tensor, cache: DynamicCache,
                       keep_logits: int | None = None) -> TargetStep:
        """The general pass behind trees and batches: ids [R, W] at positions q_pos [R, W] after the
        cache's S slots; k_pos [R, S+W] the position of every key slot (cached, then new); allowed
        [R, W, S+W] which keys each query may see. Sliding-window layers also drop keys farther than
        their window (by position, so holes and trees are handled). The cache grows by W slots.
        keep_logits=n: logits of the last n columns only ([R, n, V])."""
        if self.hybrid:
            raise NotImplementedError("custom attention masks need an attention-only target")
        masks = self._masks_per_kind(self._attention_kinds(), q_pos, k_pos, allowed)
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        want = bool(self.layer_ids)
        start = cache.get_seq_length()
        with masked_gqa(self.config):  # grouped heads without copying the cache per head (target/attention.py)
            out = self.model(input_ids=ids.to(self.device), position_ids=q_pos.to(self.device), attention_mask=mask,
                             use_cache=True, output_hidden_states=want, **{self._cache_kw: cache},
                             **self._logits_kw(keep_logits))
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1) if want else None
        return TargetStep(_last(out.logits, keep_logits), features, ids, start, None)

    def _masks_per_kind(self, kinds: dict[str, int | None], q_pos: Tensor, k_pos: Tensor,
                        allowed: Tensor) -> dict[str, Tensor]:
        """forward_masked's additive masks [R, 1, W, S+W] per layer kind: `allowed`, and on a sliding
        kind only the keys within its window of each query's position."""
        dtype = self.dtype
        masks = {}
        for kind, window in kinds.items():
            ok = allowed if window is None else allowed & (q_pos[:, :, None] - k_pos[:, None, :] < window)
            masks[kind] = torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)[:, None].to(self.device)
        return masks

    def _logits_kw(self, keep_logits: int | None) -> dict[str, int]:
        if keep_logits is not None and (isinstance(keep_logits, bool) or not isinstance(keep_logits, int)
                                        or keep_logits < 1):
            raise ValueError(f"keep_logits must be None or a positive integer, got {keep_logits!r}")
        return {"logits_to_keep": keep_logits} if keep_logits is not None and self._keeps_logits else {}

    def select_rows(self, cache: DynamicCache, rows: Tensor) -> None:
        """Keep only the batch rows `rows` of the cache (finished sequences stop costing compute).
        Keeping every row in order copies nothing."""
        if cache.layers and rows.numel() == cache.layers[0].keys.shape[0] and \
                torch.equal(rows.cpu(), torch.arange(rows.numel())):
            return
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))

    def append_rows(self, cache: DynamicCache, other: DynamicCache) -> None:
        """Append the rows of `other` to `cache` (continuous batching: prefilled newcomers join the
        running batch). The cache with fewer slots is left-padded with empty slots, which the caller
        must mask as dead."""
        if self.hybrid:
            raise NotImplementedError("batched caches need an attention-only target")
        for mine, theirs in zip(cache.layers, other.layers):  # [N, heads, S, head_dim]: slots are dim 2
            mine.keys = cat_rows_left_padded(mine.keys, theirs.keys, slot_dim=2)
            mine.values = cat_rows_left_padded(mine.values, theirs.values, slot_dim=2)

    def keep_slots(self, cache: DynamicCache, slots: Tensor) -> None:
        """Keep only the cache slots `slots` (ascending), in every row."""
        if self.hybrid:
            raise NotImplementedError("hybrid targets can only keep a prefix of their cache")
        for layer in cache.layers:  # DynamicLayer: [N, heads, S, head_dim]
            layer.keys = layer.keys.index_select(-2, slots.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, slots.to(layer.values.device))

    def keep(self, cache: DynamicCache, step: TargetStep, rows: list[int]) -> None:
        """Keep, of the tokens `step` added, those at `rows` (ascending: the anchor and a path): their
        entries move down in place to follow the cached prefix, and the cache is cropped after them."""
        if rows == list(range(len(rows))):
            self.rollback(cache, step, len(rows))
            return
        self.keep_block(cache, step.start, torch.tensor([rows]))

    def keep_block(self, cache: DynamicCache, start: int, slots: Tensor) -> None:
        """`keep` for every row: of the slots the last pass added after the first `start`, row r keeps
        slots[r] ([R, n], ascending), moved down in place to follow the cached prefix; every row is
        then cropped to start + n slots."""
        if self.hybrid:
            raise NotImplementedError("hybrid targets can only keep a prefix of their cache")
        R, n = slots.shape
        if not torch.equal(slots.cpu(), torch.arange(n).expand(R, n)):  # otherwise a crop is all it takes
            for layer in cache.layers:  # [R, heads, S, head_dim]
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    index = (start + slots).to(t.device)[:, None, :, None].expand(R, t.shape[1], n, t.shape[3])
                    t[:, :, start: start + n] = t.gather(2, index)
        self.crop(cache, start + n)

    def _attention_kinds(self) -> dict[str, int | None]:
        """Attention layer kinds of the target and their sliding window (None: full attention)."""
        impl = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if impl not in ("eager", "sdpa"):
            raise NotImplementedError(f"verify='tree' builds a custom attention mask: it needs attn_implementation "
                                      f"'eager' or 'sdpa', the target uses {impl!r}")
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if not types:  # Mistral-style: one kind for every layer
            use = getattr(self.config, "use_sliding_window", True) is not False
            return {"full_attention": window if use else None}
        if "chunked_attention" in types:
            raise NotImplementedError("verify='tree' does not support chunked-attention targets; use verify='path'")
        return {kind: (window if kind == "sliding_attention" else None) for kind in dict.fromkeys(types)}

    def crop(self, cache: DynamicCache, length: int) -> None:
        """Keep the first `length` positions. A negative count works on every 5.x cache API."""
        remove = cache.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
        if remove:
            cache.crop(-remove)


def _last(logits: Tensor, keep: int | None) -> Tensor:
    """logits [R, T, V] → their last `keep` positions (a model without `logits_to_keep` gives all T)."""
    return logits if keep is None else logits[:, -keep:]


def cat_rows_left_padded(a: Tensor, b: Tensor, slot_dim: int) -> Tensor:
    """Stack a [R, ..., S, ...] and b [n, ..., T, ...] along rows (dim 0), left-padding the one with
    fewer slots (along `slot_dim`) with zeros: empty cache slots, or False in a live-slot mask."""
    S, T = a.shape[slot_dim], b.shape[slot_dim]
    pad = lambda t, k: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - slot_dim) + (k, 0))  # noqa: E731
    return torch.cat([pad(a, max(T - S, 0)), pad(b, max(S - T, 0))])


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    major, minor = re.match(r"(\d+)\.(\d+)", transformers.__version__).groups()
    return int(major), int(minor)


def _is_hybrid(config) -> bool:
    """True for targets with linear-attention layers; raises for recurrent layers we cannot roll back."""
    model_type = getattr(config, "model_type", type(config).__name__)
    layer_types = set(getattr(config, "layer_types", None) or ())
    odd = sorted(layer_types - ATTENTION_LAYER_TYPES - ROLLBACK_LAYER_TYPES)
    if odd or model_type in RECURRENT_MODEL_TYPES:
        detail = f" (layer types {odd})" if odd else ""
        raise NotImplementedError(
            f"target model type {model_type!r} has recurrent-state layers{detail} whose state cannot be rolled back "
            "after a partial acceptance; supported recurrent layers: linear_attention (Gated DeltaNet)"
        )
    return bool(layer_types & ROLLBACK_LAYER_TYPES)


def _snapshot(cache: DynamicCache) -> list[dict[str, Any]]:
    """Each layer's attributes: K/V by reference (only ever concatenated), the rest copied."""
    return [{k: v if k in ("keys", "values") else copy.deepcopy(v) for k, v in vars(layer).items()}
            for layer in cache.layers]


def _restore(cache: DynamicCache, snapshot: list[dict[str, Any]]) -> None:
    for layer, state in zip(cache.layers, snapshot):
        layer.__dict__.clear()
        layer.__dict__.update(state)
