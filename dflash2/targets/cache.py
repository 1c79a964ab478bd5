"""A target KV-cache layer that appends in place.

transformers' `DynamicLayer` appends by concatenation: every forward pass copies the layer's whole
cache into a new tensor. `GrowingLayer` keeps each of keys/values as a view `[:, :, :n]` of a buffer
with spare slots, so a pass writes only its new entries. Everything else in transformers and in the
adapter keeps working on `layer.keys` / `layer.values` as before: a crop is a shorter view of the
same buffer; code that assigns new tensors (dropping rows or slots, appending rows) simply makes the
next update start a new buffer from them. In-place writes into the view (`TargetAdapter.keep_block`)
land in the buffer.

What it saves is in docs/architecture.md, "Performance choices".
"""

from __future__ import annotations

from torch import Tensor
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are prefix views of buffers grown by half when full."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = n + key_states.shape[-2]
        buffers = getattr(self, "_buffers", None)
        if buffers is None or end > buffers[0].shape[-2] or not (
                _prefix_of(self.keys, buffers[0]) and _prefix_of(self.values, buffers[1])):
            buffers = tuple(_buffer_for(old, new, n, end) for old, new in ((self.keys, key_states),
                                                                           (self.values, value_states)))
            self._buffers = buffers
        buffers[0][:, :, n:end] = key_states
        buffers[1][:, :, n:end] = value_states
        self.keys, self.values = buffers[0][:, :, :end], buffers[1][:, :, :end]
        return self.keys, self.values


def _prefix_of(view: Tensor, buffer: Tensor) -> bool:
    """Is `view` buffer[:, :, :n] for some n (same storage start, rows, heads, strides)?"""
    return (view.dim() == 4 and view.data_ptr() == buffer.data_ptr() and view.shape[:2] == buffer.shape[:2]
            and view.shape[3] == buffer.shape[3] and view.stride() == buffer.stride())


def _buffer_for(old: Tensor, new: Tensor, n: int, end: int) -> Tensor:
    """A buffer [N, heads, capacity, hd] with room for `end` slots and more, holding old's n slots."""
    N, heads, _, hd = new.shape
    buffer = new.new_empty(N, heads, end + end // 2 + 16, hd)
    if n:
        buffer[:, :, :n] = old
    return buffer
