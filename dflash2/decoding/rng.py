"""The random source of decoding, injectable so that tests can enumerate every branch.

Everything random in drafting and verification goes through two primitives. The default wraps a
`torch.Generator`; tests substitute a source that walks all outcomes with their probabilities.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class RandomSource(Protocol):
    def categorical(self, probs: Tensor) -> int:
        """Draw an index from a 1-D probability vector [V] (sums to 1, non-negative)."""
        ...

    def bernoulli(self, p: float) -> bool:
        """True with probability p (0 <= p <= 1)."""
        ...


class TorchRandom:
    """RandomSource backed by a torch.Generator (the global one when generator is None)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def categorical(self, probs: Tensor) -> int:
        """Inverse transform: the first index whose cumulative mass (float64) exceeds u × the total, u
        uniform in [0, 1). An index of zero mass adds nothing to the cumulative, so it is never drawn.
        (torch.multinomial over a vocabulary took several times as long for one draw; categorical_rows
        over one row runs more small operators than this.)"""
        cdf = torch.cumsum(probs, 0, dtype=torch.float64)
        device = self.generator.device if self.generator is not None else probs.device
        u = torch.rand((), generator=self.generator, dtype=torch.float64, device=device).to(probs.device)
        i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        if i >= probs.shape[0]:  # u × total rounded up to the total: the last index with mass
            i = int((probs > 0).nonzero()[-1, 0])
        return i

    def categorical_rows(self, probs: Tensor) -> list[int]:
        """categorical() of each row of probs [R, V], in row order, in one go: the same R uniforms
        (torch.rand of R draws what R calls draw), the same draws."""
        cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # [R, V]
        device = self.generator.device if self.generator is not None else probs.device
        u = torch.rand(probs.shape[0], generator=self.generator, dtype=torch.float64, device=device).to(probs.device)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
        # u × total rounded up to the total: the last index with mass
        return [i if i < probs.shape[1] else int((probs[r] > 0).nonzero()[-1, 0]) for r, i in enumerate(drawn)]

    def bernoulli(self, p: float) -> bool:
        if p >= 1.0:
            return True
        device = self.generator.device if self.generator is not None else "cpu"
        return bool(torch.rand((), generator=self.generator, device=device).item() < p)


def categorical_rows(rng: RandomSource, probs: Tensor) -> list[int]:
    """One draw from each row of probs [R, V], in row order: rng.categorical row by row, in one go where
    the source offers it (TorchRandom.categorical_rows; a test's enumerating source draws row by row)."""
    rows = getattr(rng, "categorical_rows", None)
    return rows(probs) if rows is not None else [rng.categorical(p) for p in probs]
