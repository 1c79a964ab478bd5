"""What a round costs on the running machine: `CostModel` (verify seconds against the tokens of one
target pass) and the profilers a GoodputPolicy is primed with: `profile_verify` (batch 1),
`profile_verify_batch` (the padded pass at R rows), `profile_draft` (drafting seconds per round) and
`profile_loop` (the loop's own seconds outside the pass and the drafting). Each runs the public loops
or the target's own passes on random prompts and leaves no trace."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash2.decoding.batch import prefill_rows, spec_generate_batch
from dflash2.decoding.checks import adapt_target
from dflash2.decoding.loop import spec_generate
from dflash2.decoding.sealed import SealedDrafts
from dflash2.targets.adapter import TargetAdapter


@dataclass(frozen=True)
class CostModel:
    """verify seconds against tokens in one target pass: points (tokens, seconds), tokens increasing."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        tokens = [n for n, _ in self.points]
        if not self.points or tokens != sorted(set(tokens)) or tokens[0] < 1 or any(s < 0 for _, s in self.points):
            raise ValueError(f"CostModel needs points (tokens >= 1, strictly increasing; seconds >= 0), got {self.points}")
        object.__setattr__(self, "_memo", {})  # tokens → seconds: a policy reads a few dozen sizes every round

    def verify_s(self, tokens: int) -> float:
        """Seconds of a target pass over `tokens` tokens: interpolated between the measured points,
        the first point's value below them, the last segment's slope above them."""
        memo = self._memo  # type: ignore[attr-defined]
        if tokens not in memo:
            memo[tokens] = self._interpolate(tokens)
        return memo[tokens]

    def _interpolate(self, tokens: int) -> float:
        xs = [n for n, _ in self.points]
        if len(xs) == 1 or tokens <= xs[0]:
            return self.points[0][1]
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))

    @classmethod
    def measure(cls, run: Callable[[int], None], sizes: list[int], repeats: int = 3) -> "CostModel":
        """Time run(n) for each n in sizes (best of `repeats`, after one warm-up call each). The sizes
        take turns (each repetition times every size once), so that the machine's drift over the
        profile touches every size alike instead of the last ones. A pass over more tokens costs no
        less, and a timing's noise only adds: each point is then the least time measured at its size
        or above."""
        sizes = sorted(set(sizes))
        for n in sizes:
            run(n)
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(repeats):
            for n in sizes:
                start = time.perf_counter()
                run(n)
                best[n] = min(best[n], time.perf_counter() - start)
        points = [(n, best[n]) for n in sizes]
        for i in range(len(points) - 2, -1, -1):  # the least time at this size or above
            points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
        return cls(tuple(points))


def profile_verify(target, sizes: tuple[int, ...] = (0, 1, 2, 4, 8, 16), context: int = 256,
                   repeats: int = 3) -> CostModel:
    """The verify cost of a target on this machine: a scratch cache prefilled with `context` tokens,
    then target passes over 1 + n tokens (n in sizes, the drafted tokens; 0: a plain step), each
    rolled back; best of `repeats` (a second or two for a small target). target: a TargetAdapter or StaticTarget (or an
    HF causal LM, wrapped)."""
    tgt = target if hasattr(target, "new_cache") and hasattr(target, "keep") else TargetAdapter(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tgt.vocab_size, (1, context + 1 + max(sizes)), generator=g).to(tgt.device)
    cache = tgt.new_cache()
    with torch.no_grad():
        tgt.forward(ids[:, :context], cache, keep_logits=1)

        def run(tokens: int) -> None:
            step = tgt.forward(ids[:, context:context + tokens], cache)
            if tgt.device.type == "cuda":
                torch.cuda.synchronize(tgt.device)
            tgt.keep(cache, step, [])  # back to the context

        return CostModel.measure(run, [1 + n for n in sizes], repeats)


def profile_verify_batch(target, rows: int, sizes: tuple[int, ...] = (0, 1, 2, 4, 8, 16), context: int = 128,
                         repeats: int = 3) -> CostModel:
    """profile_verify for `spec_generate_batch`'s padded pass: `rows` rows prefilled with `context`
    tokens each, then passes over [rows, 1 + n] (n in sizes), each rolled back. Points are in tokens of
    the padded pass (rows × (1 + n)), as GoodputPolicy(padded=True) reads them. target: a TargetAdapter
    (or an HF causal LM, wrapped)."""
    tgt = target if isinstance(target, TargetAdapter) else TargetAdapter(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tgt.vocab_size, (context,), generator=g) for _ in range(rows)]
    ids = torch.randint(0, tgt.vocab_size, (rows, 1 + max(sizes)), generator=g)
    with torch.no_grad():
        cache, valid, pos, *_ = prefill_rows(tgt, prompts)
        S = valid.shape[1]

        def run(tokens: int) -> None:
            W = tokens // rows
            q_pos = pos[:, -1:] + 1 + torch.arange(W)  # [rows, W]
            causal = torch.ones(W, W, dtype=torch.bool).tril().expand(rows, W, W)
            allowed = torch.cat([valid[:, None, :].expand(rows, W, S), causal], dim=2)
            tgt.forward_masked(ids[:, :W].to(tgt.device), q_pos, torch.cat([pos, q_pos], dim=1), allowed, cache)
            if tgt.device.type == "cuda":
                torch.cuda.synchronize(tgt.device)
            tgt.keep_block(cache, S, torch.zeros(rows, 0, dtype=torch.long))  # back to the context

        return CostModel.measure(run, [rows * (1 + n) for n in sizes], repeats)


def profile_draft(drafter, target, rows: int = 1, context: int = 128, rounds: int = 4, verify: str = "path",
                  tree_nodes: int = 15) -> float:
    """The drafting seconds of one round at `rows` rows on this machine: `rows` random prompts of
    `context` tokens decoded for `rounds` + 1 rounds (spec_generate at one row, spec_generate_batch
    at more), twice (the first run compiles what a compiled drafter compiles), the fastest round of
    the second run after its first (which also reads the whole prompt's features) among those with
    every row still in flight (rows that accept more finish first, and a round of the few left drafts
    a fraction of the batch; were none left with every row, the fullest rounds' scaled to `rows`). A prior for
    GoodputPolicy(draft_s=...), so that its first round need not draft to learn it (the policy counts
    it as its first measurement at that number of rows). verify="tree": a tree of `tree_nodes` nodes
    per row (TreeGoodputPolicy's drafting)."""
    tgt = adapt_target(drafter, target)
    ids = torch.randint(0, tgt.vocab_size, (rows, context), generator=torch.Generator().manual_seed(0))
    budget = rounds + 2 + drafter.block_size  # a first round that commits a whole block leaves a timed round
    for _ in range(2):
        timer = _DraftTimer()
        with torch.no_grad():
            if rows == 1:
                spec_generate(drafter, tgt, ids.to(tgt.device), max_new_tokens=budget, policy=timer, verify=verify,
                              tree_nodes=tree_nodes)
            else:
                spec_generate_batch(drafter, tgt, ids.to(tgt.device), max_new_tokens=budget, policy=timer,
                                    verify=verify, tree_nodes=tree_nodes)
    if not timer.seconds:
        raise ValueError("profile_draft: the drafter drafted nothing (block_size 1, or an autoregressive drafter)")
    fullest = max(n for n, _ in timer.seconds)
    return min(s for n, s in timer.seconds if n == fullest) * rows / fullest


def by_rows(table: dict[int, float], rows: int) -> float | None:
    """table's value at `rows`, else at the next larger number (fewer rows cost no more), else the
    largest scaled up linearly; None for an empty table."""
    if rows in table or not table:
        return table.get(rows)
    larger = [r for r in table if r > rows]
    if larger:
        return table[min(larger)]
    most = max(table)
    return table[most] * rows / most


def profile_loop(drafter, target, rows: int = 1, context: int = 128, steps: int = 17,
                 cost: CostModel | None = None) -> float:
    """The loop's own seconds per round at `rows` rows on this machine, outside the target pass and
    the drafting: `steps` plain steps of spec_generate (spec_generate_batch at more rows) with a policy
    that never drafts, on random prompts of `context` tokens, twice (the fastest run's seconds per step
    after the prefill), less the pass a plain step makes, from `cost` (profile_verify or
    profile_verify_batch at these rows; without it, the whole step's seconds). For
    GoodputPolicy(loop_s=...)."""
    tgt = adapt_target(drafter, target)
    ids = torch.randint(0, tgt.vocab_size, (rows, context), generator=torch.Generator().manual_seed(1))
    best = float("inf")
    with torch.no_grad():
        for _ in range(2):
            if rows == 1:
                out = spec_generate(drafter, tgt, ids.to(tgt.device), max_new_tokens=steps, policy=_NeverDraft())
            else:
                out = spec_generate_batch(drafter, tgt, ids.to(tgt.device), max_new_tokens=steps,
                                          policy=_NeverDraft())[0]
            best = min(best, (out.total_s - out.prefill_s) / max(steps - 1, 1))  # the first token comes from the prefill
    return max(0.0, best - (cost.verify_s(rows) if cost is not None else 0.0))


class _NeverDraft:
    """A plain step every round (profile_loop)."""

    def drafts(self, rows: int) -> bool:
        return False

    def widths(self, drafts: SealedDrafts, draft_s: float) -> list[int]:
        return list(drafts.lengths)

    def observe(self, draft, verified: int, accepted: list[int]) -> None:
        pass


class _DraftTimer(_NeverDraft):
    """Drafts and verifies every round, recording each drafting round's rows and seconds (profile_draft)."""

    def __init__(self) -> None:
        self.seconds: list[tuple[int, float]] = []

    def drafts(self, rows: int) -> bool:
        return True

    def widths(self, drafts: SealedDrafts, draft_s: float) -> list[int]:
        if any(drafts.lengths) and draft_s is not None:
            self.seconds.append((drafts.rows, draft_s))
        return list(drafts.lengths)



__all__ = ["CostModel", "by_rows", "profile_draft", "profile_loop", "profile_verify", "profile_verify_batch"]
