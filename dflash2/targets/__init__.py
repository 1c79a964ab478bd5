"""The target model: the one adapter over a Hugging Face causal LM, and its helpers.

    adapter.py    TargetAdapter: forward, tree and masked (batched) passes, the cache operations
                  (rollback, keep, select_rows, keep_slots, append_rows), the borrowed embedding and
                  LM head, hybrid (linear-attention) snapshots; every transformers version detail
    cache.py      GrowingLayer: a cache layer with spare capacity (appends without reallocating)
    attention.py  masked_gqa: grouped-query attention under an explicit mask (tree and batch passes)
    static.py     StaticTarget: the model's own layers over a preallocated cache, for torch.compile
"""

from dflash2.targets.adapter import HYBRID_MIN_TRANSFORMERS, TargetAdapter, TargetStep, cat_rows_left_padded, transformers_version
from dflash2.targets.static import StaticTarget

__all__ = ["HYBRID_MIN_TRANSFORMERS", "StaticTarget", "TargetAdapter", "TargetStep", "cat_rows_left_padded",
           "transformers_version"]
