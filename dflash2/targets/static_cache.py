"""StaticTarget's cache: per layer, key and value buffers preallocated as [rows, kv_heads, slots, hd]
(batch 1: slot = position), grown by doubling when a pass or an admission outruns them; a rollback only
moves the length back, and keeping a row's accepted slots moves a few columns in place. `StaticCacheOps`
is the mixin of StaticTarget that allocates and edits them (its TargetAdapter fallbacks take other caches)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash2.targets.adapter import TargetStep


@dataclass
class StaticCache:
    """Per layer keys/values [row capacity, kv_heads, slot capacity, hd], the slots in use (`length`;
    batch 1: slot = position) and the rows in use (`rows`: buffer rows 0..rows-1)."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    length: int = 0
    rows: int = 1

    def views(self) -> tuple[list[Tensor], list[Tensor]]:
        """The buffers' rows in use, per layer ([rows, kv_heads, slot capacity, hd] views)."""
        return [k[: self.rows] for k in self.keys], [v[: self.rows] for v in self.values]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class _Writer:
    """What a decoder layer sees as its cache during one pass: `update` writes the pass's K/V into
    the buffers from slot `start` on and returns every slot up to the pass's end."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], start: int) -> None:
        self.keys, self.values, self.start = keys, values, start

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        end = self.start + key_states.shape[-2]
        self.keys[layer_idx][:, :, self.start:end] = key_states
        self.values[layer_idx][:, :, self.start:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start


class StaticCacheOps:
    """StaticTarget's cache operations (a mixin before TargetAdapter, whose own run on its caches)."""

    def new_cache(self) -> StaticCache:
        return StaticCache()

    def _reserve(self, cache: StaticCache, slots: int) -> None:
        """Check that `slots` slots fit (at most `capacity`); the buffers hold twice the slots of a
        cache's first pass, and twice what they held when a pass fills them (within capacity; the
        slots in use copied). Buffers of the whole capacity from the start made every decode zero
        megabytes per layer before its first token. A pass never ends at the buffers' last slot
        (short of capacity): the compiled step's graphs are warmed up on passes that end short of
        it, and a slice to the very end would compile another."""
        if slots > self.capacity:
            raise ValueError(f"the sequence needs {slots} cache slots; this StaticTarget holds {self.capacity}")
        have = cache.keys[0].shape[2] if cache.keys else 0
        if slots >= have and have < self.capacity:
            self._resize(cache, 1, min(self.capacity, 2 * max(slots, have)))

    def crop(self, cache, length: int) -> None:
        if not isinstance(cache, StaticCache):
            return super().crop(cache, length)
        if length > cache.length:
            raise ValueError(f"cannot crop a cache of {cache.length} positions to {length}")
        cache.length = length

    def _reserve_rows(self, cache: StaticCache, rows: int, slots: int) -> None:
        """Buffers for at least `rows` rows and `slots` slots: allocated on a cache's first pass (as
        wide as needed), then doubled in the dimension outrun, the contents copied (rarely: a batch's
        slots grow by one pass at a time, its rows by admissions)."""
        if cache.keys and rows <= cache.keys[0].shape[0] and slots <= cache.keys[0].shape[2]:
            return
        if not cache.keys:  # the first pass: exactly as large as it needs
            self._resize(cache, rows, slots)
            return
        have_rows, have_slots = cache.keys[0].shape[0], cache.keys[0].shape[2]
        self._resize(cache, have_rows if rows <= have_rows else max(rows, 2 * have_rows),
                     have_slots if slots <= have_slots else max(slots, 2 * have_slots))

    def _resize(self, cache: StaticCache, rows: int, slots: int) -> None:
        """New zeroed buffers [rows, kv_heads, slots, hd] per layer, holding the cache's rows and slots
        in use (a new cache: `rows` rows in use)."""
        attn = self.decoder.layers[0].self_attn
        kv_heads = getattr(attn, "num_key_value_heads", None) or self.config.num_key_value_heads
        weight = self.model.get_input_embeddings().weight
        if not cache.keys:
            cache.keys, cache.values = [None] * self.num_layers, [None] * self.num_layers
            cache.rows = rows
        R, S = cache.rows, cache.length
        for buffers in (cache.keys, cache.values):
            for i, old in enumerate(buffers):
                buffers[i] = weight.new_zeros(rows, kv_heads, slots, attn.head_dim)
                if old is not None:
                    buffers[i][:R, :, :S] = old[:R, :, :S]

    def select_rows(self, cache, rows: Tensor) -> None:
        """Keep only the batch rows `rows`, in that order, moved to the buffers' first rows."""
        if not isinstance(cache, StaticCache):
            return super().select_rows(cache, rows)
        n = rows.numel()
        if n == cache.rows and torch.equal(rows.cpu(), torch.arange(n)):
            return
        index = rows.to(self.device)
        for buffers in (cache.keys, cache.values):
            for b in buffers:
                b[:n, :, : cache.length] = b[:, :, : cache.length].index_select(0, index)
        cache.rows = n

    def append_rows(self, cache, other) -> None:
        """The rows of `other` (a prefilled StaticCache) join `cache` after its rows. The cache with
        fewer slots is left-padded (its slots move right), as the caller pads its masks."""
        if not isinstance(cache, StaticCache):
            return super().append_rows(cache, other)
        if not other.keys or other.rows == 0:
            return
        S, S2, R, n = cache.length, other.length, cache.rows, other.rows
        L = max(S, S2)
        self._reserve_rows(cache, R + n, L)
        for mine, theirs in ((cache.keys, other.keys), (cache.values, other.values)):
            for b, t in zip(mine, theirs):
                if S < L:  # the running rows' slots move right by L - S
                    b[:R, :, L - S: L] = b[:R, :, :S].clone()
                b[R: R + n, :, L - S2: L] = t[:n, :, :S2]
        cache.rows, cache.length = R + n, L

    def keep(self, cache, step: TargetStep, rows: list[int]) -> None:
        """TargetAdapter.keep on a one-row StaticCache: of the kept entries (the anchor and a tree's
        accepted path, ascending) only those not in place already move, each buffer in two operations."""
        if not isinstance(cache, StaticCache) or cache.rows != 1:
            return super().keep(cache, step, rows)
        n = len(rows)
        moved = next((i for i, r in enumerate(rows) if r != i), n)  # rows[:moved] are in place
        if moved < n:
            src = torch.tensor([step.start + r for r in rows[moved:]], device=self.device)
            for b in cache.keys + cache.values:  # [1, kv, slots, hd]; index_select copies before the write
                b[:, :, step.start + moved: step.start + n] = b.index_select(2, src)
        cache.length = step.start + n

    def keep_slots(self, cache, slots: Tensor) -> None:
        """Keep only the slots `slots` (ascending), in every row, moved to the front."""
        if not isinstance(cache, StaticCache):
            return super().keep_slots(cache, slots)
        index = slots.to(self.device)
        for buffers in (cache.keys, cache.values):
            for b in buffers:
                b[: cache.rows, :, : index.numel()] = b[: cache.rows, :, : cache.length].index_select(2, index)
        cache.length = index.numel()

    def keep_block(self, cache, start: int, slots: Tensor) -> None:
        """Row r keeps the pass's slots slots[r] ([R, n], ascending), moved down to follow the first
        `start` slots; every row is cropped to start + n slots."""
        if not isinstance(cache, StaticCache):
            return super().keep_block(cache, start, slots)
        R, n = slots.shape
        if not torch.equal(slots.cpu(), torch.arange(n).expand(R, n)):  # otherwise a crop is all it takes
            keys, values = cache.views()
            for b in keys + values:
                index = (start + slots).to(self.device)[:, None, :, None].expand(R, b.shape[1], n, b.shape[3])
                b[:, :, start: start + n] = b.gather(2, index)
        cache.length = start + n
