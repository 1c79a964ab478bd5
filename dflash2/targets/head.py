"""The target's frozen embedding and LM head as a drafter reads them: `TargetHead`, a mixin of
TargetAdapter (its `model` and `config`; `_head_copies`, the head cast to a drafter's dtype, kept)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash2.layers import as_rows


class TargetHead:
    """Embedding rows, LM-head logits (all, a draft vocabulary's, or K candidates'), the target's own
    final logits, and the head's weights in a drafter's dtype."""

    def embed(self, ids: Tensor) -> Tensor:
        """ids [...] → [..., H]: rows of the target's frozen input embedding matrix. The raw matrix,
        not the embedding module, as the published drafters read it: a module that scales its output
        (Gemma's × √H) is matched by the drafter's `input_embedding_scale` instead."""
        return torch.nn.functional.embedding(ids, self.model.get_input_embeddings().weight)

    def embedding_scale(self) -> float | None:
        """The factor by which the target's embedding module scales the matrix's rows (None: it
        does not). Raises when the module does something other than a scaled lookup."""
        module = self.model.get_input_embeddings()
        weight = module.weight
        ids = torch.arange(min(16, weight.shape[0]), device=weight.device)
        with torch.no_grad():
            out, raw = module(ids), torch.nn.functional.embedding(ids, weight)
        if torch.equal(out, raw):
            return None
        scale = getattr(module, "embed_scale", None)
        scale = float(scale) if scale is not None else float(out.double().norm() / raw.double().norm())
        tolerance = 1e-2 if weight.dtype in (torch.bfloat16, torch.float16) else 1e-5
        if not torch.allclose(out.double(), raw.double() * scale, rtol=tolerance, atol=tolerance * 1e-3):
            raise ValueError(f"the target's input embedding ({type(module).__name__}) is not a (scaled) lookup of "
                             "its weight matrix; set input_embedding_scale yourself")
        return None if scale == 1.0 else scale

    def lm_logits(self, hidden: Tensor, vocab: Tensor | None = None) -> Tensor:
        """hidden [..., H] → [..., V] with the target's frozen LM head (differentiable in `hidden`:
        training backpropagates through it; the head's own weights stay frozen). With `vocab` [V']
        (token ids) → [..., V']: the logits of those tokens only, from those rows of the head.

        A drafter may run in another dtype than the target (e.g. a bfloat16 drafter for a float32
        target: the draft never changes what is committed, only how often it is accepted). Its
        hidden states then go through a copy of the head in their dtype, cast once and kept; so do
        the rows of a draft vocabulary."""
        head = self.model.get_output_embeddings()
        flat = as_rows(hidden)  # [n, H]
        if not isinstance(head, nn.Linear):  # a head with its own forward: run it in its dtype, then pick
            logits = head(flat.to(head.weight.dtype)).to(hidden.dtype)
            logits = logits if vocab is None else logits[:, vocab]
        elif vocab is not None:
            logits = F.linear(flat, *self._head_in(hidden.dtype, vocab))
        elif hidden.dtype == head.weight.dtype:
            logits = head(flat)
        else:
            logits = F.linear(flat, *self._head_in(hidden.dtype))
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def lm_logits_at(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """hidden [..., H], ids [..., K] → [..., K]: `lm_logits(hidden).gather(-1, ids)` from the K rows
        of the head each position needs (no [..., V] logits; differentiable in `hidden`)."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return self.lm_logits(hidden).gather(-1, ids)
        weight, bias = self.head_weights(hidden.dtype)
        logits = torch.einsum("...h,...kh->...k", hidden, F.embedding(ids, weight))
        return logits if bias is None else logits + bias[ids]

    def final_logits(self, hidden: Tensor) -> Tensor:
        """The target's own next-token logits from its final (normed) hidden state [..., H] → [..., V]:
        its LM head, then the soft-capping its config declares (Gemma 2), as its forward computes them."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else cap * torch.tanh(logits / cap)

    def head_weights(self, dtype: torch.dtype, vocab: Tensor | None = None) -> tuple[Tensor, Tensor | None] | None:
        """The LM head as (weight [V, H], bias [V] or None) in `dtype` (its `vocab` rows [V'] only), so
        that `F.linear(hidden, *head_weights(hidden.dtype))` equals `lm_logits(hidden)`; None for a head
        with its own forward (not an nn.Linear), which only `lm_logits` runs."""
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            return None
        if vocab is None and head.weight.dtype == dtype:
            return head.weight, head.bias
        return self._head_in(dtype, vocab)

    def _head_in(self, dtype: torch.dtype, vocab: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The LM head's weight and bias (their `vocab` rows) cast to `dtype`, redone only when the
        head or the rows change. One copy is kept for the whole head and one for a draft vocabulary."""
        head = self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        key = (dtype, head.weight.data_ptr(), head.weight._version)
        if vocab is not None:
            key += (vocab.data_ptr(), vocab._version, vocab.numel())
        slot = 0 if vocab is None else 1
        if self._head_copies[slot] is None or self._head_copies[slot][0] != key:
            with torch.no_grad():
                rows = slice(None) if vocab is None else vocab.to(head.weight.device)
                cast = (head.weight[rows].to(dtype).contiguous(), None if bias is None else bias[rows].to(dtype))
            self._head_copies[slot] = (key, cast)
        return self._head_copies[slot][1]
